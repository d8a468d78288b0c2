"""DNS discovery with a stub resolver: replicas follow what a name resolves to."""

from __future__ import annotations

from gateway.config import DiscoveryConfig, QueueConfig
from gateway.discovery import DnsDiscovery
from gateway.policies import make_policy
from gateway.router import Router


class StubResolver:
    """Answers from a list the test changes; raises when told to."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.fail = False

    async def resolve(self, name: str, port: int) -> list[str]:
        if self.fail:
            raise OSError("temporary failure in name resolution")
        return list(self.addresses)


async def test_replicas_follow_dns_answers() -> None:
    """New addresses become replicas, vanished ones are dropped, and a failed lookup keeps what we had."""
    router = Router(make_policy("round_robin"), QueueConfig())
    resolver = StubResolver()
    discovery = DnsDiscovery(router, DiscoveryConfig(name="vllm.ns.svc", port=8000, max_requests=8), resolver)
    resolver.addresses = ["10.0.0.1", "10.0.0.2"]
    await discovery.refresh()
    assert sorted(router.replicas) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert router.replicas["http://10.0.0.1:8000"].max_requests == 8
    resolver.addresses = ["10.0.0.2", "10.0.0.3", "fd00::5"]
    await discovery.refresh()
    assert sorted(router.replicas) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://[fd00::5]:8000"]
    resolver.fail = True
    await discovery.refresh()
    assert len(router.replicas) == 3
