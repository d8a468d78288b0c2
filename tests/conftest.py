"""Shared fixtures: in-process FAKE vLLM replicas and a gateway in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from gateway.app import Gateway, running
from gateway.config import from_mapping
from tests.fake_replica import BEHAVIOR, STATS, FakeBehavior, FakeStats, make_app as make_fake


@dataclass
class Fake:
    """A running fake replica: its URL and the knobs and counters of its app."""

    server: TestServer
    behavior: FakeBehavior
    stats: FakeStats

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


@dataclass
class GatewayUnderTest:
    port: int
    gateway: Gateway

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


FakeFactory = Callable[..., Awaitable[Fake]]
GatewayFactory = Callable[..., Awaitable[GatewayUnderTest]]


@pytest.fixture(scope="session")
def tiny_tokenizer() -> str:
    """The tiny model's directory (made once): the tokenizer of the replica models in docs/bench, which name the
    path it had where they were calibrated."""
    from deploy.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture
def fake_replica(aiohttp_server: Any) -> FakeFactory:
    """Start a fake replica: `await fake_replica(ttft_s=..., itl_s=..., fail=...)`."""
    async def start(**knobs: Any) -> Fake:
        app = make_fake(FakeBehavior(**knobs))
        server = await aiohttp_server(app)
        return Fake(server, app[BEHAVIOR], app[STATS])
    return start


@pytest.fixture
async def gateway_for() -> AsyncIterator[GatewayFactory]:
    """Start a gateway in front of the given replica URLs (or replica mappings), probed once before it returns."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(replicas: list[Any], **settings: Any) -> GatewayUnderTest:
            settings.setdefault("health", {"interval_s": 60, "timeout_s": 1})
            config = from_mapping({"replicas": replicas, "host": "127.0.0.1", "port": 0, **settings})
            gateway, port = await stack.enter_async_context(running(config, grace_s=1))
            assert gateway.health is not None
            await gateway.health.probe_all()
            return GatewayUnderTest(port, gateway)
        yield start


def mark_healthy(gateway: Gateway, *urls: str, models: tuple[str, ...] = ("fake-model",)) -> None:
    """As if a probe had just found these replicas (default: all) healthy and serving `models`."""
    assert gateway.control is not None
    replicas = gateway.control.replicas
    for url in urls or list(replicas.replicas):
        replicas.set_health(replicas.replicas[url], True, {m: {"id": m, "object": "model"} for m in models})


async def until(condition: Callable[[], bool], timeout_s: float = 1.0) -> None:
    """Wait until `condition()` holds or `timeout_s` passes (the caller asserts what it needs afterwards)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


