"""Replicas that refuse, fail, stall or die: the gateway retries while it is safe and never strands a client."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import openai
import pytest

from deploy.ports import free_ports
from tests.conftest import FakeFactory, GatewayFactory, mark_healthy, until

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_ports()}"


async def test_503_is_retried_on_another_replica(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A replica answering 503 before any byte is skipped: every request succeeds on the other one."""
    bad = await fake_replica(fail="refuse")
    good = await fake_replica()
    gw = await gateway_for([bad.url, good.url], policy="round_robin")
    bad.behavior.fail = "refuse"
    mark_healthy(gw.gateway)
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0) as client:
        for _ in range(6):
            await client.completions.create(**BODY)
    assert len(good.stats.bodies) == 6
    assert len(bad.stats.bodies) == 1  # tried once, then ejected until a probe takes it back


async def test_refused_connection_is_retried(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A replica whose port refuses connections costs a retry, not a failed request."""
    good = await fake_replica()
    dead = closed_port_url()
    gw = await gateway_for([dead, good.url], policy="round_robin")
    mark_healthy(gw.gateway, dead)  # as if it had just died after a good probe
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0) as client:
        for _ in range(4):
            await client.completions.create(**BODY)
    assert len(good.stats.bodies) == 4
    assert not gw.gateway.router.replicas[dead].healthy
    async with aiohttp.ClientSession() as session:
        metrics = await (await session.get(gw.url + "/metrics")).text()
    assert 'gateway_retries_total{reason="connection"} 1.0' in metrics


async def test_retries_are_bounded(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """When every replica refuses, the client gets one 502 after a bounded number of attempts."""
    fakes = [await fake_replica() for _ in range(4)]
    gw = await gateway_for([f.url for f in fakes], retry={"max_attempts": 2, "max_time_s": 5})
    for f in fakes:
        f.behavior.fail = "refuse"
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", json=BODY) as resp:
            assert resp.status == 502
            body = await resp.json()
    assert "after 2 attempt(s)" in body["error"]["message"]
    assert sum(len(f.stats.bodies) for f in fakes) == 2


async def test_500_is_passed_through_and_ejects(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A 500 is not retried (the replica may have done the work) but takes the replica out of rotation."""
    bad = await fake_replica()
    gw = await gateway_for([bad.url])
    bad.behavior.fail = "error"
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", json=BODY) as resp:
            assert resp.status == 500
    assert not gw.gateway.router.replicas[bad.url].healthy


async def test_stalled_replica_times_out_and_is_retried(fake_replica: FakeFactory,
                                                        gateway_for: GatewayFactory) -> None:
    """A replica that accepts and never answers hits the first-byte timeout; the request moves on."""
    stalled = await fake_replica()
    good = await fake_replica()
    gw = await gateway_for([stalled.url, good.url], policy="round_robin",
                           timeouts={"connect_s": 1, "first_byte_s": 0.3, "idle_s": 1})
    stalled.behavior.fail = "stall"
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0) as client:
        for _ in range(3):
            await client.completions.create(**BODY)
    assert len(good.stats.bodies) == 3
    assert not gw.gateway.router.replicas[stalled.url].healthy


async def test_death_mid_stream_ends_with_an_sse_error(fake_replica: FakeFactory,
                                                       gateway_for: GatewayFactory) -> None:
    """Once tokens reached the client, a dying replica yields a final SSE error event and a clean end."""
    fake = await fake_replica(itl_s=0.001)
    gw = await gateway_for([fake.url])
    fake.behavior.fail, fake.behavior.die_after = "die_midstream", 2
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            text = await resp.text()  # a clean end: no payload error here
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 3
    assert '"error"' in events[-1] and "upstream_stream_error" in events[-1]
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0) as client:
        mark_healthy(gw.gateway, fake.url)
        stream = await client.completions.create(**BODY, stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    replica = gw.gateway.router.replicas[fake.url]
    assert replica.outstanding == 0 and replica.inflight == 0


async def test_stall_mid_stream_hits_the_idle_timeout(fake_replica: FakeFactory,
                                                      gateway_for: GatewayFactory) -> None:
    """A replica that goes silent mid-stream is cut off after the idle timeout, with an SSE error to the client."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], timeouts={"connect_s": 1, "first_byte_s": 5, "idle_s": 0.2})
    fake.behavior.fail, fake.behavior.die_after = "stall_midstream", 3
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", json={**BODY, "stream": True}) as resp:
            text = await asyncio.wait_for(resp.text(), timeout=5)
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 4 and "stalled for 0.2 s" in events[-1]
    replica = gw.gateway.router.replicas[fake.url]
    assert not replica.healthy and replica.outstanding == 0 and replica.inflight == 0


async def test_slow_steady_stream_is_not_taken_for_a_stall(fake_replica: FakeFactory,
                                                           gateway_for: GatewayFactory) -> None:
    """Tokens 0.12 s apart under an idle timeout of 0.2 s, for six times that timeout: the stream is never cut.

    Tokens relayed from the replica connection's callback are seen by the watchdog's tick (`Watch.moved`, gateway/watchdogs.py), not
    timed one by one; this is the case where that could go wrong: every gap is more than half the limit.
    """
    fake = await fake_replica(itl_s=0.12)
    gw = await gateway_for([fake.url], timeouts={"connect_s": 1, "first_byte_s": 5, "idle_s": 0.2})
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", json={**BODY, "max_tokens": 11, "stream": True}) as resp:
            text = await asyncio.wait_for(resp.text(), timeout=10)
    events = [e for e in text.split("\n\n") if e]
    assert "error" not in text and len(events) == 12 and events[-1] == "data: [DONE]", text
    replica = gw.gateway.router.replicas[fake.url]
    assert replica.healthy and replica.outstanding == 0 and replica.inflight == 0


async def test_streamed_tokens_count_down_the_load_while_the_stream_runs(fake_replica: FakeFactory,
                                                                        gateway_for: GatewayFactory) -> None:
    """A long stream's output budget comes back as its tokens are relayed (eight at a time), not only at its end."""
    fake = await fake_replica(itl_s=0.01)
    gw = await gateway_for([fake.url])
    replica = gw.gateway.router.replicas[fake.url]
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions",
                                json={**BODY, "max_tokens": 1000, "stream": True}) as resp:
            seen = b""
            while seen.count(b"data:") < 40:
                seen += await resp.content.readany()
            assert 0 < replica.outstanding <= 1000 - 40 + 8  # counted down to within one batch of what came
            await resp.read()
    assert replica.outstanding == 0 and replica.inflight == 0


async def test_client_disconnect_aborts_upstream_and_releases_tokens(fake_replica: FakeFactory,
                                                                     gateway_for: GatewayFactory) -> None:
    """A client that goes away mid-stream closes the upstream request at once and frees its tokens."""
    fake = await fake_replica(itl_s=0.05)
    gw = await gateway_for([fake.url])
    replica = gw.gateway.router.replicas[fake.url]
    async with aiohttp.ClientSession() as session:
        resp = await session.post(gw.base_url + "/completions", json={**BODY, "max_tokens": 1000, "stream": True})
        await resp.content.readany()
        assert fake.stats.running == 1 and replica.outstanding > 0
        resp.close()  # the client hangs up
    await until(lambda: fake.stats.running == 0 and replica.inflight == 0)
    assert fake.stats.running == 0 and fake.stats.aborted == 1
    assert replica.outstanding == 0 and replica.inflight == 0


async def test_ejected_replica_comes_back_after_a_good_probe(fake_replica: FakeFactory,
                                                             gateway_for: GatewayFactory) -> None:
    """Passive ejection lasts until the next successful probe."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], health={"interval_s": 0.05, "timeout_s": 1})
    fake.behavior.fail = "error"
    async with aiohttp.ClientSession() as session:
        await session.post(gw.base_url + "/completions", json=BODY)
        assert not gw.gateway.router.replicas[fake.url].healthy
        fake.behavior.fail = None
        await until(lambda: gw.gateway.router.replicas[fake.url].healthy, timeout_s=2.0)
        async with session.post(gw.base_url + "/completions", json=BODY) as resp:
            assert resp.status == 200


async def test_slow_client_is_not_taken_for_a_stalled_replica(fake_replica: FakeFactory,
                                                              gateway_for: GatewayFactory) -> None:
    """A client that reads slower than the replica writes waits on back-pressure; the idle timeout does not fire."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], timeouts={"connect_s": 1, "first_byte_s": 5, "idle_s": 0.2})
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions",
                                json={**BODY, "max_tokens": 30000, "stream": True}) as resp:
            await resp.content.readany()
            await asyncio.sleep(0.8)  # socket buffers fill; the gateway must stop reading, not give up
            text = (await resp.read()).decode()
    assert "error" not in text and text.rstrip().endswith("data: [DONE]")
    replica = gw.gateway.router.replicas[fake.url]
    assert replica.healthy and replica.outstanding == 0 and replica.inflight == 0


async def test_client_gone_before_the_first_token_aborts_upstream(fake_replica: FakeFactory,
                                                                  gateway_for: GatewayFactory) -> None:
    """A client that hangs up while the replica is still in prefill closes the upstream request too."""
    fake = await fake_replica(ttft_s=2.0)
    gw = await gateway_for([fake.url])
    replica = gw.gateway.router.replicas[fake.url]
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(gw.base_url + "/completions", json={**BODY, "stream": True}))
        await until(lambda: fake.stats.running == 1)
        assert fake.stats.running == 1 and replica.inflight == 1
        request.cancel()  # the client hangs up before any token
        with contextlib.suppress(asyncio.CancelledError):
            await request
    await until(lambda: fake.stats.running == 0 and replica.inflight == 0)
    assert fake.stats.running == 0 and fake.stats.aborted == 1
    assert replica.outstanding == 0 and replica.inflight == 0
