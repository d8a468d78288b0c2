"""Prometheus metrics, summed over every worker at scrape time (no global state, no lock on the request path).

Like prometheus-client's multiprocess mode, each process writes only its own memory and whoever is scraped sums
them all: a worker's counters and histograms are float64 cells in its row of the load table (`CounterStore`, an
append-only map from metric keys to cells), so a request's counts cost a dict lookup and a few stores.
prometheus-client's multiprocess values were not used: each `inc` takes a process-wide lock and packs a struct
into a file, several times the cost of the request's own routing and accounting. Live gauges (outstanding
tokens, in-flight requests, health, queue depth, the load feedback) are read from the table when scraped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .router import Router
from .table import (
    H_RESTARTS,
    INFLIGHT,
    OUTSTANDING,
    PREFILL,
    R_QUEUE,
    R_STATE,
    S_KV,
    S_RUNNING,
    S_WAITING,
    STATE_READY,
    LoadTable,
)

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, math.inf)
_LE = tuple("+Inf" if bound == math.inf else repr(float(bound)) for bound in _LATENCY_BUCKETS)  # as Prometheus writes them
_WIDTH = len(_LATENCY_BUCKETS) + 1  # a histogram's cells: a count per bucket (not cumulative), then the sum
_FIRST_ENTRY = 64  # bytes: the region's first cell holds how many of its bytes are used
_SCRATCH = 32  # cells at the region's end, never read: where counts go once the region is full


class CounterStore:
    """One process's metric cells: entries of [key length, width, key (padded to 8 bytes), width float64s].

    Entries are appended and never moved; `used` is written after an entry is complete, so a reader in another
    process parses only whole entries. A replacement worker continues its dead predecessor's counts.
    """

    def __init__(self, region: memoryview) -> None:
        self._bytes = region
        self._cells = region.cast("q")
        self.values = region.cast("d")
        self._index: dict[tuple[str, ...], int] = {key: cell for key, cell, _ in _entries(region)}
        if self._cells[0] == 0:
            self._cells[0] = _FIRST_ENTRY
        self._full = False

    def cell(self, key: tuple[str, ...], width: int = 1) -> int:
        """The index in `values` of the first of `width` cells for `key` (made, zeroed, on first use)."""
        cell = self._index.get(key)
        if cell is not None:
            return cell
        raw = json.dumps(key).encode()
        padded = -(-len(raw) // 8) * 8
        start = int(self._cells[0])
        end = start + 16 + padded + 8 * width
        scratch = len(self._bytes) // 8 - _SCRATCH
        if end > scratch * 8 or width > _SCRATCH:
            if not self._full:
                logger.error("the metrics region is full (%d bytes): new label sets are not counted", len(self._bytes))
                self._full = True
            return scratch
        self._bytes[start + 16:start + 16 + len(raw)] = raw
        self._cells[start // 8], self._cells[start // 8 + 1] = len(raw), width
        cell = (start + 16 + padded) // 8
        self._cells[0] = end  # published: readers now see the whole entry
        self._index[key] = cell
        return cell


def _entries(region: memoryview) -> Iterator[tuple[tuple[str, ...], int, int]]:
    cells = region.cast("q")
    used, offset = int(cells[0]), _FIRST_ENTRY
    while offset < used:
        length, width = int(cells[offset // 8]), int(cells[offset // 8 + 1])
        key = tuple(json.loads(bytes(region[offset + 16:offset + 16 + length])))
        cell = (offset + 16 + -(-length // 8) * 8) // 8
        yield key, cell, width
        offset = cell * 8 + width * 8


class RegionReader:
    """Reads one key's cells in every region, re-parsing a region's index only when it has grown."""

    def __init__(self) -> None:
        self._indexes: dict[int, tuple[int, dict[tuple[str, ...], int]]] = {}

    def values(self, regions: Iterable[memoryview], key: tuple[str, ...]) -> Iterator[float]:
        """The first cell of `key` in each region that has it."""
        for i, region in enumerate(regions):
            used = int(region.cast("q")[0])
            seen = self._indexes.get(i)
            if seen is None or seen[0] != used:
                seen = self._indexes[i] = (used, {k: cell for k, cell, _ in _entries(region)})
            cell = seen[1].get(key)
            if cell is not None:
                yield region.cast("d")[cell]


def totals(regions: Iterable[memoryview]) -> dict[tuple[str, ...], list[float]]:
    """Every key's cells summed over the regions (one per worker)."""
    out: dict[tuple[str, ...], list[float]] = {}
    for region in regions:
        values = region.cast("d")
        for key, cell, width in _entries(region):
            sums = out.setdefault(key, [0.0] * width)
            for i in range(width):
                sums[i] += values[cell + i]
    return out


class _Child:
    __slots__ = ("_values", "_cell")

    def __init__(self, values: memoryview[float], cell: int) -> None:
        self._values, self._cell = values, cell

    def inc(self, amount: float = 1.0) -> None:
        self._values[self._cell] += amount


class LabelledCounter:
    """A counter with labels, kept in the store (`counter.labels("timeout").inc()`, as with prometheus-client)."""

    def __init__(self, store: CounterStore, name: str) -> None:
        self._store, self._name = store, name
        self._children: dict[tuple[str, ...], _Child] = {}

    def labels(self, *values: str) -> _Child:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Child(self._store.values, self._store.cell((self._name, *values)))
        return child


class _Families(Collector):
    """Everything the gateway exports, built from the table when scraped."""

    def __init__(self, router: Router, table: LoadTable, worker_rows: range) -> None:
        self._router, self._table, self._rows = router, table, worker_rows

    def collect(self) -> Iterator[Metric]:
        table = self._table
        hi = table.hi
        yield from self._counted(totals(table.metric_region(row) for row in range(hi)))
        yield from self._live(range(self._rows.start, max(self._rows.start, hi)))
        workers = sum(table.cells[table.head_cell(row, R_STATE)] == STATE_READY for row in range(1, hi))
        yield GaugeMetricFamily("gateway_workers", "Worker processes serving", value=workers)
        yield CounterMetricFamily("gateway_worker_restarts", "Workers restarted after they died",
                                  value=table.cells[H_RESTARTS])

    def _counted(self, sums: dict[tuple[str, ...], list[float]]) -> Iterator[Metric]:
        requests = CounterMetricFamily("gateway_requests", "Requests answered, by replica, model and HTTP status",
                                       labels=["replica", "model", "status"])
        retries = CounterMetricFamily("gateway_retries", "Requests retried on another replica (adapter_missing: "
                                      "after loading the adapter a replica had lost), by reason", labels=["reason"])
        rejections = CounterMetricFamily("gateway_rejections", "Requests refused, by reason", labels=["reason"])
        shed = CounterMetricFamily("gateway_connections_shed", "Client connections closed at the connection cap to "
                                   "make room for a new one, by reason", labels=["reason"])
        durations = HistogramMetricFamily("gateway_request_duration_seconds", "Time from request to last byte",
                                          labels=["replica", "model"])
        ttft = HistogramMetricFamily("gateway_time_to_first_token_seconds",
                                     "Time from request to first streamed token", labels=["replica", "model"])
        loads = CounterMetricFamily("gateway_lora_loads", "LoRA adapters loaded onto a replica by the gateway",
                                    labels=["replica", "adapter"])
        unloads = CounterMetricFamily("gateway_lora_unloads", "LoRA adapters unloaded (least recently used first) "
                                      "to make room", labels=["replica", "adapter"])
        failures = CounterMetricFamily("gateway_lora_load_failures", "LoRA adapter loads that failed",
                                       labels=["replica", "adapter"])
        by_name = {"requests": requests, "retries": retries, "rejections": rejections, "shed": shed,
                   "lora_loads": loads, "lora_unloads": unloads, "lora_load_failures": failures}
        histograms = {"duration": durations, "ttft": ttft}
        for (name, *labels), cells in sorted(sums.items()):
            if name in by_name:
                by_name[name].add_metric(labels, cells[0])
            elif name in histograms:
                running, buckets = 0.0, []
                for le, count in zip(_LE, cells):
                    running += count
                    buckets.append((le, running))
                histograms[name].add_metric(labels, buckets, cells[-1])
        yield from (requests, durations, ttft, retries, rejections, shed)
        if loads.samples or unloads.samples or failures.samples:
            yield from (loads, unloads, failures)

    def _live(self, rows: range) -> Iterator[Metric]:
        table, replicas = self._table, [r for r in self._router.replicas.values() if r.slot >= 0]
        own = (("gateway_replica_outstanding_tokens", "Outstanding tokens (prompt + unfinished output) per replica",
                OUTSTANDING, rows),
               ("gateway_replica_inflight_requests", "Requests in flight per replica", INFLIGHT, rows),
               ("gateway_replica_prefill_tokens", "Prompt tokens of requests with no first token yet, per replica",
                PREFILL, rows),
               ("gateway_replica_feedback_tokens", "Outstanding tokens other clients hold per replica, estimated "
                "from its /metrics (load feedback)", OUTSTANDING, range(0, 1)),
               ("gateway_replica_feedback_requests", "Requests other clients hold per replica, from its /metrics "
                "(load feedback)", INFLIGHT, range(0, 1)))
        for name, doc, column, over in own:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica in replicas:
                family.add_metric([replica.url], table.total(replica.slot, column, over))
            yield family
        for name, doc, cell in (("gateway_replica_vllm_requests_running", "vllm:num_requests_running as scraped",
                                 S_RUNNING),
                                ("gateway_replica_vllm_requests_waiting", "vllm:num_requests_waiting as scraped",
                                 S_WAITING),
                                ("gateway_replica_vllm_kv_cache_usage", "vllm:kv_cache_usage_perc as scraped (0..1)",
                                 S_KV)):
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica in replicas:
                family.add_metric([replica.url], table.floats[table.slot_cell(replica.slot, cell)])
            yield family
        healthy = GaugeMetricFamily("gateway_replica_healthy", "1 if the replica is taking traffic", labels=["replica"])
        for replica in self._router.replicas.values():
            healthy.add_metric([replica.url], int(replica.healthy))
        yield healthy
        depth = sum(table.cells[table.head_cell(row, R_QUEUE)] for row in rows)
        yield GaugeMetricFamily("gateway_queue_depth", "Requests waiting in the admission queues",
                                value=max(depth, self._router.queue_depth))


class _Runtime(Collector):
    """The event loop's live tasks (one per client connection, plus background ones): a leak shows as growth."""

    def collect(self) -> Iterator[Metric]:
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped outside the event loop (a test rendering directly)
            return
        yield GaugeMetricFamily("gateway_asyncio_tasks", "asyncio tasks alive in the process that answered the scrape",
                                value=tasks)


class Metrics:
    """The gateway's counters and histograms, in this process's row of the load table."""

    def __init__(self, router: Router, table: LoadTable, row: int, worker_rows: range) -> None:
        self.registry = CollectorRegistry()
        self.store = self._store = store = CounterStore(table.metric_region(row))
        self._values = store.values
        self.retries = LabelledCounter(store, "retries")
        self.rejections = LabelledCounter(store, "rejections")
        self.connections_shed = LabelledCounter(store, "shed")  # "no_request_head": HttpServer's on_shed
        self._counts: dict[tuple[str, str, int], int] = {}
        self._latency: dict[tuple[str, str], int] = {}
        self._ttft: dict[tuple[str, str], int] = {}
        self.registry.register(_Families(router, table, worker_rows))
        self.registry.register(_Runtime())
        # process_open_fds, process_resident_memory_bytes, ...: read from /proc at scrape, for the answering process
        ProcessCollector(registry=self.registry)

    def answered(self, replica: str, model: str, status: int, seconds: float) -> None:
        """One request answered by `replica`: count it and observe its duration."""
        key = (replica, model, status)
        cell = self._counts.get(key)
        if cell is None:
            cell = self._counts[key] = self._store.cell(("requests", replica, model, str(status)))
        values = self._values
        values[cell] += 1
        labels = (replica, model)
        cell = self._latency.get(labels)
        if cell is None:
            cell = self._latency[labels] = self._store.cell(("duration", replica, model), _WIDTH)
        values[cell + bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        values[cell + _WIDTH - 1] += seconds

    def first_token(self, replica: str, model: str, seconds: float) -> None:
        """A stream's first token reached the gateway `seconds` after the request did."""
        labels = (replica, model)
        cell = self._ttft.get(labels)
        if cell is None:
            cell = self._ttft[labels] = self._store.cell(("ttft", replica, model), _WIDTH)
        values = self._values
        values[cell + bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        values[cell + _WIDTH - 1] += seconds

    def render(self) -> bytes:
        return generate_latest(self.registry)
