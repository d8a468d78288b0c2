"""Active health probes of the replica set: each replica's /health on an interval; its models from /v1/models.

The control plane probes (once for all workers) and publishes the results through the `ReplicaSet`; a worker
that sees a replica fail a request ejects it (`eject`) for every worker until its next good probe.

A replica whose batch cap (max_num_seqs) the config does not give gets it from its `/metrics`, when the
`vllm:cache_config_info` labels carry it (`sim serve` does; vLLM 0.32's carry the cache config only, so with
vLLM the plan or config gives it, or the admission cap `max_requests` stands in for it).
"""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp

from .config import HealthConfig
from .limits import OUT_OF_DESCRIPTORS
from .replicas import Replica
from .replicaset import Entry, ReplicaSet

logger = logging.getLogger(__name__)

MODELS_EVERY = 10  # refresh a healthy replica's model list every this many probes
_MAX_NUM_SEQS = re.compile(r'^vllm:cache_config_info\{[^}\n]*\bmax_num_seqs="(\d+)"', re.M)


class HealthChecker:
    """Probes every replica of the set; a replica ejected for a failed request comes back on its next good probe."""

    def __init__(self, replicas: ReplicaSet, session: aiohttp.ClientSession, config: HealthConfig,
                 headers: dict[str, str] | None = None) -> None:
        self._replicas = replicas
        self._session = session
        self._config = config
        self._headers = headers or {}
        self._rounds = 0

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self._config.interval_s)

    async def probe_all(self) -> None:
        refresh = self._rounds % MODELS_EVERY == 0
        self._rounds += 1
        await asyncio.gather(*(self.probe(e, refresh) for e in list(self._replicas.replicas.values())))

    async def probe(self, entry: Entry, refresh_models: bool = False) -> None:
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        cards = None
        try:
            async with self._session.get(f"{entry.url}/health", timeout=timeout, headers=self._headers) as resp:
                ok = resp.status == 200
            if ok and (refresh_models or not entry.healthy or not entry.cards):
                cards = await self._models(entry, timeout)
                if entry.config.max_num_seqs is None and entry.batch_cap is None:
                    self._replicas.set_batch_cap(entry, await self._batch_cap(entry, timeout))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
                # The gateway is out of file descriptors, which says nothing about the replica: keep its state.
                logger.warning("cannot probe %s: %s", entry.url, exc)
                return
            ok = False
            logger.debug("probe of %s failed: %r", entry.url, exc)
        self._replicas.set_health(entry, ok, cards)

    async def _batch_cap(self, entry: Entry, timeout: aiohttp.ClientTimeout) -> int | None:
        """max_num_seqs from the replica's /metrics when it exports it; None otherwise (never a failed probe)."""
        try:
            async with self._session.get(f"{entry.url}/metrics", timeout=timeout, headers=self._headers) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            logger.debug("no metrics from %s: %r", entry.url, exc)
            return None
        match = _MAX_NUM_SEQS.search(text)
        if match:
            logger.info("replica %s runs batches of up to %s (max_num_seqs, from its metrics)", entry.url,
                        match.group(1))
        return int(match.group(1)) if match else None

    async def _models(self, entry: Entry, timeout: aiohttp.ClientTimeout) -> dict[str, dict[str, object]]:
        async with self._session.get(f"{entry.url}/v1/models", timeout=timeout, headers=self._headers) as resp:
            resp.raise_for_status()
            body = await resp.json()
        return {m["id"]: m for m in body.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)}


def eject(replica: Replica, reason: str) -> None:
    """Passive ejection: stop sending traffic to a replica that just failed a request (in every worker)."""
    if replica.healthy:
        logger.warning("ejecting replica %s: %s", replica.url, reason)
    replica.healthy = False
    replica.mark_ejected()
