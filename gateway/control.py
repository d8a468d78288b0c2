"""The control plane: the replica set and everything that changes it, run once per gateway (not once per worker).

It holds the `ReplicaSet` and runs DNS discovery, the health probes and the load feedback against it; workers
follow what it publishes in the load table. With N workers it runs in the supervisor; with one, in the gateway's
own process. Runtime changes (a config reload on SIGHUP today, an admin API later) call `ReplicaSet.add`,
`remove` or `drain` here, and reach every worker within `FOLLOW_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from .config import GatewayConfig
from .discovery import DnsDiscovery, Resolver, SystemResolver
from .feedback import LoadFeedback
from .health import HealthChecker
from .replicaset import ReplicaSet
from .table import LoadTable

logger = logging.getLogger(__name__)

REAP_S = 0.5  # how often removed and drained replicas are checked for requests still running


class ControlPlane:
    """Static replicas, DNS discovery, health probes and load feedback, all writing one `ReplicaSet`."""

    def __init__(self, config: GatewayConfig, table: LoadTable, worker_rows: range, resolver: Resolver | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.config = config
        self.replicas = ReplicaSet(table, worker_rows, on_change)
        for replica in config.replicas:
            self.replicas.add(replica)
        self.resolver = resolver or SystemResolver()
        self.discovery: dict[DnsDiscovery, asyncio.Task[None] | None] = {
            DnsDiscovery(self.replicas, d, self.resolver): None for d in config.discovery}
        self.health: HealthChecker | None = None
        self.feedback: LoadFeedback | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Open the probe client; start discovery, health checks, load feedback and the reaper."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.timeouts.connect_s, sock_read=None))  # each call sets its own total
        key = self.config.upstream_api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.health = HealthChecker(self.replicas, self._session, self.config.health, headers)
        for discovery in self.discovery:
            self.discovery[discovery] = asyncio.create_task(discovery.run(), name="dns-discovery")
        self._tasks = [asyncio.create_task(self.health.run(), name="health-checks"),
                       asyncio.create_task(self._reap(), name="replica-reaper")]
        if self.config.feedback.enabled:
            self.feedback = LoadFeedback(self.replicas, self._session, self.config.feedback,
                                         self.config.default_max_tokens, headers)
            self._tasks.append(asyncio.create_task(self.feedback.run(), name="load-feedback"))

    async def stop(self) -> None:
        tasks = self._tasks + [t for t in self.discovery.values() if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_S)
            self.replicas.reap()

    def reload(self, config: GatewayConfig) -> None:
        """Apply a new config's replicas and discovery entries (SIGHUP); other settings need new workers."""
        listed = {r.url for r in config.replicas}
        for replica in config.replicas:
            self.replicas.add(replica)
        for replica in self.config.replicas:
            if replica.url not in listed:
                logger.info("replica %s is no longer configured: removing it", replica.url)
                self.replicas.remove(replica.url)
        for discovery, task in list(self.discovery.items()):
            if discovery.config not in config.discovery:
                if task is not None:
                    task.cancel()
                del self.discovery[discovery]
                for url in discovery.urls:
                    self.replicas.remove(url)
        known = {d.config for d in self.discovery}
        for entry in config.discovery:
            if entry not in known:
                discovery = DnsDiscovery(self.replicas, entry, self.resolver)
                self.discovery[discovery] = (asyncio.create_task(discovery.run(), name="dns-discovery")
                                             if self._session is not None else None)
        self.config = config
