"""`gateway serve --workers N`, run as a user would (a subprocess), in front of FAKE replicas in this process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.ports import free_ports
from tests.conftest import FakeFactory

ROOT = Path(__file__).resolve().parent.parent
SHORT = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


@dataclass
class Served:
    """A `gateway serve` process: its port and its supervisor."""

    process: subprocess.Popen[bytes]
    port: int
    config: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value, from one scrape (whichever worker answers it)."""
        async with aiohttp.ClientSession() as session, session.get(self.url + "/metrics") as resp:
            text = await resp.text()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
        return out


ServeFactory = Callable[..., Awaitable[Served]]


async def _wait(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if await condition():
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} within {timeout_s} s")


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[ServeFactory]:
    """Start `gateway serve --workers N` over the given replicas; every worker serving before it returns."""
    started: list[Served] = []

    async def start(replicas: list[Any], workers: int = 2, **settings: Any) -> Served:
        port = free_ports()
        config = tmp_path / f"gateway-{port}.yaml"
        settings.setdefault("health", {"interval_s": 0.2, "timeout_s": 1})
        config.write_text(yaml.safe_dump({"replicas": replicas, "host": "127.0.0.1", "port": port,
                                          "workers": workers, "log_level": "warning", **settings}))
        process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=ROOT)
        served = Served(process, port, config)
        started.append(served)

        async def ready() -> bool:
            m = await served.metrics()
            return m.get("gateway_workers") == workers and any(
                k.startswith("gateway_replica_healthy") and v == 1 for k, v in m.items())
        await _wait(ready, 30, f"{workers} workers serving")
        return served

    yield start
    for served in started:
        if served.process.poll() is None:
            served.process.send_signal(signal.SIGTERM)
        try:
            served.process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait()


async def short(session: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    """One short completion on a new connection: (the replica, the worker) that served it."""
    async with session.post(url + "/v1/completions", json=SHORT, headers={"Connection": "close"}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-gateway-replica"], resp.headers["x-gateway-worker"]


async def test_short_requests_avoid_the_busy_replica_whichever_worker_takes_them(
        fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """A long stream through one worker: short requests through either worker go to the other replica."""
    a, b = await fake_replica(itl_s=0.01), await fake_replica(itl_s=0.01)
    gw = await serve([a.url, b.url])
    long_body = {"model": "fake-model", "prompt": "hi", "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/completions", json=long_body) as long_resp:
            busy, long_worker = long_resp.headers["x-gateway-replica"], long_resp.headers["x-gateway-worker"]
            await long_resp.content.readline()
            seen = [await short(session, gw.url) for _ in range(24)]
            workers = {w for _, w in seen}
            assert len(workers) == 2 and long_worker in workers, seen  # both workers took short ones
            assert all(replica != busy for replica, _ in seen), seen
            assert (a if busy == a.url else b).stats.running == 1


async def test_metrics_totals_match_the_requests_sent(fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """Whichever worker is scraped, /metrics counts every request every worker answered."""
    fakes = [await fake_replica(), await fake_replica()]
    gw = await serve([f.url for f in fakes])
    async with aiohttp.ClientSession() as session:
        served = [await short(session, gw.url) for _ in range(30)]
        for _ in range(10):
            async with session.post(gw.url + "/v1/completions", json={**SHORT, "stream": True},
                                    headers={"Connection": "close"}) as resp:
                await resp.read()
    assert len({w for _, w in served}) == 2
    for _ in range(4):  # scrapes land on either worker
        m = await gw.metrics()
        assert sum(v for k, v in m.items() if k.startswith("gateway_requests_total")) == 40
        assert sum(v for k, v in m.items() if k.startswith("gateway_time_to_first_token_seconds_count")) == 10
    assert sum(len(f.stats.bodies) for f in fakes) == 40


async def test_a_worker_killed_under_load_is_restarted_and_its_reservations_released(
        fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """SIGKILL one worker mid-stream: the other worker's streams finish whole; the books return to zero."""
    fakes = [await fake_replica(itl_s=0.01), await fake_replica(itl_s=0.01)]
    gw = await serve([f.url for f in fakes])
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 100, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        responses = [await session.post(gw.url + "/v1/completions", json=body) for _ in range(16)]
        by_worker: dict[str, list[aiohttp.ClientResponse]] = {}
        for resp in responses:
            by_worker.setdefault(resp.headers["x-gateway-worker"], []).append(resp)
        assert len(by_worker) == 2, "the kernel spread 16 connections over both workers"
        victim, survivor = sorted(by_worker)
        await asyncio.sleep(0.2)
        os.kill(int(victim), signal.SIGKILL)
        for resp in by_worker[survivor]:
            text = await resp.text()
            assert text.count("data: {") == 100 and text.endswith("data: [DONE]\n\n")
        for resp in by_worker[victim]:
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()

    async def recovered() -> bool:
        m = await gw.metrics()
        books = [v for k, v in m.items() if k.startswith(("gateway_replica_outstanding_tokens",
                                                         "gateway_replica_inflight_requests"))]
        return (m.get("gateway_workers") == 2 and m.get("gateway_worker_restarts_total") == 1
                and len(books) == 4 and not any(books))
    await _wait(recovered, 15, "a new worker serving and every reservation released")
    async with aiohttp.ClientSession() as session:
        assert len({w for _, w in [await short(session, gw.url) for _ in range(16)]} - {victim}) == 2


async def test_admission_caps_hold_across_workers_within_the_stated_overshoot(
        fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """max_requests 2 per replica, 2 workers, 24 requests at once: never more than 2 + (2 - 1) on a replica."""
    fake = await fake_replica(ttft_s=0.05, itl_s=0.01)
    gw = await serve([{"url": fake.url, "max_requests": 2}], queue={"max_size": 64, "max_wait_s": 30})
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0) as client:
        results = await asyncio.gather(*(client.completions.create(model="fake-model", prompt="hi", max_tokens=8)
                                         for _ in range(24)))
    assert len(results) == 24
    assert 2 <= fake.stats.max_running <= 3


async def test_health_is_probed_once_per_interval_not_once_per_worker(
        fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """Four workers, one prober: about one /health a replica sees per interval."""
    fake = await fake_replica()
    await serve([fake.url], workers=4, health={"interval_s": 0.25, "timeout_s": 1})
    before, started = fake.stats.health_probes, time.monotonic()
    await asyncio.sleep(2.0)
    rounds = (time.monotonic() - started) / 0.25
    assert rounds * 0.5 <= fake.stats.health_probes - before <= rounds + 2


async def test_sigterm_drains_every_worker(fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """SIGTERM to the supervisor: streams in flight on both workers finish, then everything exits 0."""
    fake = await fake_replica(itl_s=0.01)
    gw = await serve([fake.url])
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 60, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        # The kernel hashes each connection to a worker: 8 all on one is a 1-in-128 coin flip, so open more
        # (up to 40) until both workers hold a stream.
        responses = [await session.post(gw.url + "/v1/completions", json=body) for _ in range(8)]
        while len({r.headers["x-gateway-worker"] for r in responses}) < 2 and len(responses) < 40:
            responses.append(await session.post(gw.url + "/v1/completions", json=body))
        assert len({r.headers["x-gateway-worker"] for r in responses}) == 2
        gw.process.send_signal(signal.SIGTERM)
        for resp in responses:
            assert (await resp.text()).count("data: {") == 60
    assert await asyncio.to_thread(gw.process.wait, 20) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", gw.port), timeout=1).close()


async def test_sighup_reloads_the_replicas_into_every_worker(fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """A replica added to the config file serves through both workers after SIGHUP; the workers are replaced."""
    a, b = await fake_replica(), await fake_replica()
    # By load alone: under prefix_affinity the same prompt on an idle pool stays on its replica, by design.
    gw = await serve([a.url], policy="least_outstanding_tokens")
    async with aiohttp.ClientSession() as session:
        before = {w for _, w in [await short(session, gw.url) for _ in range(12)]}
        config = yaml.safe_load(gw.config.read_text())
        config["replicas"] = [a.url, b.url]
        gw.config.write_text(yaml.safe_dump(config))
        gw.process.send_signal(signal.SIGHUP)

        async def both_serve_b() -> bool:
            seen = [await short(session, gw.url) for _ in range(12)]
            return {w for r, w in seen if r == b.url} == {w for _, w in seen} and len({w for _, w in seen}) == 2
        await _wait(both_serve_b, 20, "every worker sending to the new replica")

        async def replaced() -> bool:
            after = {w for _, w in [await short(session, gw.url) for _ in range(12)]}
            return len(after) == 2 and not before & after
        await _wait(replaced, 20, "new worker processes serving, the old ones gone")
    assert (await gw.metrics())["gateway_worker_restarts_total"] == 0  # replaced, not crashed


async def test_a_bad_port_fails_at_start_with_a_message(fake_replica: FakeFactory) -> None:
    """The supervisor binds the port before any worker starts: a taken port is a one-line error."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "gateway.cli", "serve", "--replica", "http://127.0.0.1:9", "--host", "127.0.0.1",
            "--port", str(port), "--workers", "2"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "cannot serve on" in result.stderr and "Traceback" not in result.stderr


async def test_a_conversation_keeps_its_replica_whichever_worker_takes_each_turn(
        fake_replica: FakeFactory, serve: ServeFactory) -> None:
    """prefix_affinity needs no shared state: sixteen chats of three turns, each turn on a new connection (so either
    worker may take it), each chat on one replica, the chats over both replicas and both workers. (A chat's home
    hangs on a hash of its prefix and the replicas' random ports: as coin flips, eight chats all land on one
    replica once in 128 runs, which a full-suite run hit; sixteen, once in 32,768.)"""
    a, b = await fake_replica(), await fake_replica()
    gw = await serve([a.url, b.url])
    replicas: dict[int, set[str]] = {}
    workers: set[str] = set()
    async with aiohttp.ClientSession() as session:
        for chat in range(16):
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Chat {chat}?"}]
            for _ in range(3):
                async with session.post(gw.url + "/v1/chat/completions", headers={"Connection": "close"},
                                        json={"model": "fake-model", "messages": messages, "max_tokens": 4}) as resp:
                    assert resp.status == 200, await resp.text()
                    reply = (await resp.json())["choices"][0]["message"]["content"]
                    replicas.setdefault(chat, set()).add(resp.headers["x-gateway-replica"])
                    workers.add(resp.headers["x-gateway-worker"])
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    assert all(len(served) == 1 for served in replicas.values())
    assert {r for served in replicas.values() for r in served} == {a.url, b.url}
    assert len(workers) == 2
