"""Replica-load feedback: what each replica is running for everyone, from its vLLM `/metrics`, blended into routing.

Several gateways (pods, hosts) in front of the same replicas each see only their own reservations; a replica may
also serve clients that bypass the gateway. Every `interval_s` the control plane reads each replica's
`vllm:num_requests_running` and `vllm:num_requests_waiting` and estimates the requests held for others:

    others = max(0, running + waiting - this gateway's requests in flight there)

(this gateway's count taken as the larger of before and after the scrape, so a request sent meanwhile is not
taken for someone else's). In tokens, each of those counts as this gateway's own average outstanding tokens per
request in flight (traffic through gateways in front of one pool looks alike). Both go into row 0 of the load
table, which every pick sums with the workers' rows: policies, admission caps and the metrics see own
reservations plus others' estimated load, with no change to any of them. `vllm:kv_cache_usage_perc` is published
beside them (metrics) but not blended: it measures context held, not work left, and a full cache already shows
as waiting requests. A replica whose scrape fails counts no one else's load until it answers again.

Only the lines of the three names are read (a plain scan of the bytes: vLLM's page is about 50 KB of histograms,
which prometheus-client's parser takes ~12 ms to read against ~0.05 ms for the scan).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .config import FeedbackConfig
from .replicaset import Entry, ReplicaSet
from .table import INFLIGHT, OUTSTANDING, S_KV, S_RUNNING, S_SCRAPED, S_WAITING

logger = logging.getLogger(__name__)

RUNNING = b"vllm:num_requests_running"
WAITING = b"vllm:num_requests_waiting"
KV_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")  # the second: vLLM before V1
_SMOOTHING = 0.2  # weight of the latest sample in the tokens-per-request average


def sample_sum(page: bytes, name: bytes) -> float | None:
    """The sum of a metric's samples over all its label sets (None when the page has none)."""
    text, key, total = b"\n" + page, b"\n" + name, None
    pos = text.find(key)
    while pos >= 0:
        end = text.find(b"\n", pos + 1)
        end = len(text) if end < 0 else end
        line = text[pos + 1:end]
        after = line[len(name):len(name) + 1]
        if after in (b"{", b" "):  # not a longer name that starts with this one
            rest = line[line.find(b"} ") + 2:] if after == b"{" else line[len(name) + 1:]
            try:
                total = (total or 0.0) + float(rest.split()[0])  # value [timestamp]
            except (ValueError, IndexError):
                logger.debug("load feedback: a malformed sample line: %r", line[:200])
        pos = text.find(key, end)
    return total


class LoadFeedback:
    """Scrapes every replica's /metrics on an interval and writes what others hold there into row 0."""

    def __init__(self, replicas: ReplicaSet, session: aiohttp.ClientSession, config: FeedbackConfig,
                 default_tokens: int, headers: dict[str, str] | None = None) -> None:
        self._replicas = replicas
        self._session = session
        self._config = config
        self._headers = headers or {}
        self.tokens_per_request = float(default_tokens)
        self.scrapes = 0

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self._config.interval_s)

    async def scrape_all(self) -> None:
        self._learn_request_size()
        await asyncio.gather(*(self.scrape(e) for e in list(self._replicas.replicas.values())))

    async def scrape(self, entry: Entry) -> None:
        before = self._replicas.own_load(entry.slot)[1]
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        try:
            async with self._session.get(f"{entry.url}/metrics", timeout=timeout, headers=self._headers) as resp:
                resp.raise_for_status()
                page = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.debug("load feedback: scraping %s/metrics failed: %r", entry.url, exc)
            self._write(entry, 0.0, 0.0, 0.0, 0)
            return
        mine = max(before, self._replicas.own_load(entry.slot)[1])
        running, waiting = sample_sum(page, RUNNING), sample_sum(page, WAITING)
        kv = next((v for v in (sample_sum(page, name) for name in KV_USAGE) if v is not None), 0.0)
        others = max(0, round((running or 0.0) + (waiting or 0.0)) - mine)
        self.scrapes += 1
        self._write(entry, running or 0.0, waiting or 0.0, kv, others)

    def _write(self, entry: Entry, running: float, waiting: float, kv: float, others: int) -> None:
        table = self._replicas.table
        if self._replicas.replicas.get(entry.url) is not entry:
            return  # removed while the scrape was in flight: its slot may be someone else's soon
        floats = table.floats
        floats[table.slot_cell(entry.slot, S_RUNNING)] = running
        floats[table.slot_cell(entry.slot, S_WAITING)] = waiting
        floats[table.slot_cell(entry.slot, S_KV)] = kv
        floats[table.slot_cell(entry.slot, S_SCRAPED)] = time.monotonic()
        table.cells[table.counter(0, entry.slot, INFLIGHT)] = others
        table.cells[table.counter(0, entry.slot, OUTSTANDING)] = round(others * self.tokens_per_request)

    def _learn_request_size(self) -> None:
        """This gateway's outstanding tokens per request in flight, smoothed: the size others' requests are given."""
        tokens = requests = 0
        for entry in self._replicas.replicas.values():
            t, r = self._replicas.own_load(entry.slot)
            tokens, requests = tokens + t, requests + r
        if requests:
            self.tokens_per_request += _SMOOTHING * (tokens / requests - self.tokens_per_request)
