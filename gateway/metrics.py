"""Prometheus metrics, in a registry per app (no global state). Live gauges are read at scrape time."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .router import Router

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, math.inf)
_LE = tuple("+Inf" if bound == math.inf else repr(float(bound)) for bound in _LATENCY_BUCKETS)  # as Prometheus writes them


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


class _Histogram:
    """Bucket counts (not cumulative) and a sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * len(_LATENCY_BUCKETS)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        running, out = 0, []
        for le, count in zip(_LE, self.counts):
            running += count
            out.append((le, float(running)))
        return out


class _Answers(Collector):
    """Requests answered, their durations and times to first token, as plain numbers turned into families when scraped.

    prometheus-client's labelled children take a lock on every `inc` and `observe`; only the event loop writes
    these, so plain numbers do, for a fraction of the cost on the request path.
    """

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, int], int] = {}
        self.latency: dict[tuple[str, str], _Histogram] = {}
        self.ttft: dict[tuple[str, str], _Histogram] = {}

    @staticmethod
    def observe(histograms: dict[tuple[str, str], _Histogram], labels: tuple[str, str], seconds: float) -> None:
        histogram = histograms.get(labels)
        if histogram is None:
            histogram = histograms[labels] = _Histogram()
        histogram.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("gateway_requests", "Requests answered, by replica, model and HTTP status",
                                       labels=["replica", "model", "status"])
        for (replica, model, status), count in self.counts.items():
            requests.add_metric([replica, model, str(status)], count)
        yield requests
        for name, doc, histograms in (
                ("gateway_request_duration_seconds", "Time from request to last byte", self.latency),
                ("gateway_time_to_first_token_seconds", "Time from request to first streamed token", self.ttft)):
            family = HistogramMetricFamily(name, doc, labels=["replica", "model"])
            for labels, histogram in histograms.items():
                family.add_metric(list(labels), histogram.buckets(), histogram.total)
            yield family


class Metrics:
    """The gateway's counters and histograms."""

    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        self.retries = Counter("gateway_retries", "Requests retried on another replica, by reason", ["reason"],
                               registry=self.registry)
        self.rejections = Counter("gateway_rejections", "Requests refused, by reason", ["reason"],
                                  registry=self.registry)
        self._answers = _Answers()
        self.registry.register(self._answers)
        self.registry.register(_LiveState(router))

    def answered(self, replica: str, model: str, status: int, seconds: float) -> None:
        """One request answered by `replica`: count it and observe its duration."""
        answers = self._answers
        key = (replica, model, status)
        answers.counts[key] = answers.counts.get(key, 0) + 1
        answers.observe(answers.latency, (replica, model), seconds)

    def first_token(self, replica: str, model: str, seconds: float) -> None:
        """A stream's first token reached the gateway `seconds` after the request did."""
        self._answers.observe(self._answers.ttft, (replica, model), seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
