"""Prometheus metrics, in a registry per app (no global state). Live gauges are read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .router import Router

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _LiveState(Collector):
    """Outstanding tokens, in-flight requests, health and queue depth, read from the router when scraped."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        replicas = list(self._router.replicas.values())
        families = (
            ("gateway_replica_outstanding_tokens", "Outstanding tokens (prompt + unfinished output) per replica",
             lambda r: r.outstanding),
            ("gateway_replica_inflight_requests", "Requests in flight per replica", lambda r: r.inflight),
            ("gateway_replica_healthy", "1 if the replica is taking traffic", lambda r: int(r.healthy)),
        )
        for name, doc, value in families:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica in replicas:
                family.add_metric([replica.url], value(replica))
            yield family
        yield GaugeMetricFamily("gateway_queue_depth", "Requests waiting in the admission queue",
                                value=self._router.queue_depth)


class Metrics:
    """The gateway's counters and histograms."""

    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("gateway_requests", "Requests answered, by replica, model and HTTP status",
                                ["replica", "model", "status"], registry=self.registry)
        self.latency = Histogram("gateway_request_duration_seconds", "Time from request to last byte",
                                 ["replica", "model"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("gateway_time_to_first_token_seconds", "Time from request to first streamed token",
                              ["replica", "model"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.retries = Counter("gateway_retries", "Requests retried on another replica, by reason", ["reason"],
                               registry=self.registry)
        self.rejections = Counter("gateway_rejections", "Requests refused, by reason", ["reason"],
                                  registry=self.registry)
        self.registry.register(_LiveState(router))
        # labelled children, looked up once (`labels()` takes a lock and builds a key on every call)
        self._answered: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        self._ttft: dict[tuple[str, str], Histogram] = {}

    def answered(self, replica: str, model: str, status: int, seconds: float) -> None:
        """One request answered by `replica`: count it and observe its duration."""
        key = (replica, model, status)
        children = self._answered.get(key)
        if children is None:
            children = self._answered[key] = (self.requests.labels(replica, model, str(status)),
                                              self.latency.labels(replica, model))
        children[0].inc()
        children[1].observe(seconds)

    def first_token(self, replica: str, model: str, seconds: float) -> None:
        """A stream's first token reached the gateway `seconds` after the request did."""
        child = self._ttft.get((replica, model))
        if child is None:
            child = self._ttft[(replica, model)] = self.ttft.labels(replica, model)
        child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
