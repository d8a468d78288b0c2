"""Active health probes of the replica set: each replica's /health on an interval; its models from /v1/models.

The control plane probes (once for all workers) and publishes the results through the `ReplicaSet`; a worker
that sees a replica fail a request ejects it (`eject`) for every worker until its next good probe.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from .config import HealthConfig
from .limits import OUT_OF_DESCRIPTORS
from .replicas import Replica
from .replicaset import Entry, ReplicaSet

logger = logging.getLogger(__name__)

MODELS_EVERY = 10  # refresh a healthy replica's model list every this many probes


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
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
                # The gateway is out of file descriptors, which says nothing about the replica: keep its state.
                logger.warning("cannot probe %s: %s", entry.url, exc)
                return
            ok = False
            logger.debug("probe of %s failed: %r", entry.url, exc)
        self._replicas.set_health(entry, ok, cards)

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
