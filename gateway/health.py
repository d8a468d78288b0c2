"""Active health probes: each replica's /health on an interval; its models from /v1/models once healthy."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from .config import HealthConfig
from .replicas import Replica
from .router import Router

logger = logging.getLogger(__name__)

MODELS_EVERY = 10  # refresh a healthy replica's model list every this many probes


class HealthChecker:
    """Marks replicas healthy or not; a replica ejected for a failed request comes back on its next good probe."""

    def __init__(self, router: Router, session: aiohttp.ClientSession, config: HealthConfig,
                 headers: dict[str, str] | None = None) -> None:
        self._router = router
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
        await asyncio.gather(*(self.probe(r, refresh) for r in list(self._router.replicas.values())))

    async def probe(self, replica: Replica, refresh_models: bool = False) -> None:
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        try:
            async with self._session.get(f"{replica.url}/health", timeout=timeout, headers=self._headers) as resp:
                ok = resp.status == 200
            if ok and (refresh_models or not replica.healthy or not replica.models):
                replica.cards = await self._models(replica, timeout)
                replica.models = frozenset(replica.cards)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            ok = False
            logger.debug("probe of %s failed: %r", replica.url, exc)
        self._set(replica, ok)

    async def _models(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> dict[str, dict[str, object]]:
        async with self._session.get(f"{replica.url}/v1/models", timeout=timeout, headers=self._headers) as resp:
            resp.raise_for_status()
            body = await resp.json()
        return {m["id"]: m for m in body.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)}

    def _set(self, replica: Replica, ok: bool) -> None:
        if ok != replica.healthy:
            logger.info("replica %s is %s", replica.url, "healthy" if ok else "unhealthy")
        replica.healthy = ok
        if ok:
            self._router.wake()


def eject(replica: Replica, reason: str) -> None:
    """Passive ejection: stop sending traffic to a replica that just failed a request."""
    if replica.healthy:
        logger.warning("ejecting replica %s: %s", replica.url, reason)
    replica.healthy = False
