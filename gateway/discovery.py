"""Replicas discovered from DNS: a name resolving to several addresses (a Kubernetes headless Service, say)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Protocol

from .config import DiscoveryConfig, ReplicaConfig

logger = logging.getLogger(__name__)


class Resolver(Protocol):
    async def resolve(self, name: str, port: int) -> list[str]:
        """The addresses `name` resolves to now."""
        ...


class Pool(Protocol):
    """Where discovered replicas go: the control plane's `ReplicaSet` (or a `Router` of its own)."""

    def add(self, config: ReplicaConfig) -> object: ...

    def remove(self, url: str) -> None: ...


class SystemResolver:
    """The operating system's resolver, through the event loop."""

    async def resolve(self, name: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos})


def _url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


class DnsDiscovery:
    """Keeps the router's replicas for one DNS name equal to what the name resolves to, re-resolving on an interval."""

    def __init__(self, router: Pool, config: DiscoveryConfig, resolver: Resolver) -> None:
        self._router = router
        self._config = config
        self._resolver = resolver
        self.urls: set[str] = set()

    @property
    def config(self) -> DiscoveryConfig:
        return self._config

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._config.interval_s)

    async def refresh(self) -> None:
        c = self._config
        try:
            addresses = await asyncio.wait_for(self._resolver.resolve(c.name, c.port), timeout=c.interval_s)
        except (OSError, TimeoutError) as exc:
            # Keep the replicas we had: a DNS hiccup is no reason to drop them all.
            logger.warning("cannot resolve %s: %s; keeping %d replicas", c.name, exc, len(self.urls))
            return
        found = {_url(c.scheme, a, c.port) for a in addresses}
        for url in sorted(found - self.urls):
            logger.info("discovered replica %s from %s", url, c.name)
            self._router.add(ReplicaConfig(url=url, weight=c.weight, max_requests=c.max_requests,
                                           max_outstanding_tokens=c.max_outstanding_tokens,
                                           max_num_seqs=c.max_num_seqs))
        for url in sorted(self.urls - found):
            logger.info("replica %s left %s", url, c.name)
            self._router.remove(url)
        self.urls = found
