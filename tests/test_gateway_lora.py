"""LoRA adapters on demand (gateway/lora.py), against FAKE replicas that load and unload adapters as vLLM does."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from gateway.config import AdapterSpec, ConfigError, LoraConfig, from_mapping, to_mapping
from gateway.lora import SharedHoldings
from gateway.metrics import CounterStore
from gateway.table import LoadTable
from gateway.parsing import RequestInfo
from tests.conftest import Fake, FakeFactory, GatewayFactory, GatewayUnderTest, until
from tests.test_gateway_workers import ServeFactory, serve  # noqa: F401 (the fixture)

ADAPTERS = {f"a{i}": f"/adapters/a{i}" for i in range(4)}


def lora(max_loras: int = 2, **more: Any) -> dict[str, Any]:
    return {"adapters": ADAPTERS, "max_loras": max_loras, "sync_s": 60, **more}


async def complete(session: aiohttp.ClientSession, gw: GatewayUnderTest, model: str, max_tokens: int = 2,
                   stream: bool = False) -> tuple[int, dict[str, Any], str]:
    body = {"model": model, "prompt": "hi", "max_tokens": max_tokens, "stream": stream}
    async with session.post(gw.base_url + "/completions", json=body) as resp:
        if stream:
            await resp.read()
            return resp.status, {}, resp.headers.get("x-gateway-replica", "")
        return resp.status, await resp.json(), resp.headers.get("x-gateway-replica", "")


def loads(fake: Fake) -> list[str]:
    return [name for kind, name in fake.stats.lora_events if kind == "load"]


async def test_off_by_default(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Without registered adapters the gateway makes no adapter router and routes as before."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    assert gw.gateway.adapters is None
    async with aiohttp.ClientSession() as session:
        status, body, _ = await complete(session, gw, "a0")
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_concurrent_requests_cause_one_load_and_get_the_adapter(fake_replica: FakeFactory,
                                                                       gateway_for: GatewayFactory) -> None:
    """Twenty requests at once for an adapter nobody holds: one load, and every answer names the adapter."""
    fake = await fake_replica(lora_load_s=0.2)
    gw = await gateway_for([fake.url], lora=lora())
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(complete(session, gw, "a1") for _ in range(20)))
    assert [status for status, _, _ in answers] == [200] * 20
    assert {body["model"] for _, body, _ in answers} == {"a1"}
    assert loads(fake) == ["a1"]
    assert fake.stats.adapters == {"a1": "/adapters/a1"}  # the registered path, never the client's string


async def test_models_lists_the_registered_adapters(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """/v1/models lists the base model and every registered adapter, loaded or not; never the adapter's path."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], lora=lora())
    async with aiohttp.ClientSession() as session, session.get(gw.base_url + "/models") as resp:
        body = await resp.json()
    assert {m["id"] for m in body["data"]} == {"fake-model", *ADAPTERS}
    assert "/adapters/" not in json.dumps(body)


async def test_least_recently_used_adapter_is_unloaded_first(fake_replica: FakeFactory,
                                                              gateway_for: GatewayFactory) -> None:
    """max_loras 2: a third adapter unloads the least recently used, and the replica never holds more than 2."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], lora=lora(max_loras=2))
    async with aiohttp.ClientSession() as session:
        for model in ("a0", "a1", "a0", "a2", "a3"):
            status, body, _ = await complete(session, gw, model)
            assert status == 200 and body["model"] == model
    assert fake.stats.lora_events == [("load", "a0"), ("load", "a1"), ("unload", "a1"), ("load", "a2"),
                                      ("unload", "a0"), ("load", "a3")]
    assert fake.stats.max_adapters == 2


async def test_an_adapter_with_requests_in_flight_is_never_unloaded(fake_replica: FakeFactory,
                                                                     gateway_for: GatewayFactory) -> None:
    """The least recently used adapter is busy: the next one in LRU order goes instead."""
    fake = await fake_replica(itl_s=0.02)
    gw = await gateway_for([fake.url], lora=lora(max_loras=2))
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(complete(session, gw, "a0", max_tokens=100, stream=True))
        while fake.stats.running == 0:
            await asyncio.sleep(0.01)
        assert (await complete(session, gw, "a1"))[0] == 200  # a1 is now the more recently used
        assert (await complete(session, gw, "a2"))[0] == 200
        assert fake.stats.running == 1 and "a0" in fake.stats.adapters
        assert (await long)[0] == 200
    assert ("unload", "a1") in fake.stats.lora_events and ("unload", "a0") not in fake.stats.lora_events


async def test_a_just_loaded_adapter_is_not_unloaded_under_its_waiting_requests(
        fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Three adapters at once into two slots, slow loads: every answer is 200 and names its adapter, and the
    replica never holds more than two (requests count as in flight from the moment their replica is chosen)."""
    fake = await fake_replica(lora_load_s=0.1, itl_s=0.01)
    gw = await gateway_for([fake.url], lora=lora(max_loras=2))
    models = [f"a{i % 3}" for i in range(18)]
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(complete(session, gw, m, max_tokens=4) for m in models))
    assert [(status, body["model"]) for status, body, _ in answers] == [(200, m) for m in models]
    assert fake.stats.max_adapters <= 2


async def test_every_slot_busy_waits_then_fails_clearly(fake_replica: FakeFactory,
                                                        gateway_for: GatewayFactory) -> None:
    """max_loras 1 with its adapter streaming: a request for another waits, bounded, and gets a 502 naming it."""
    fake = await fake_replica(itl_s=0.05)
    gw = await gateway_for([fake.url], lora=lora(max_loras=1, load_timeout_s=0.3))
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(complete(session, gw, "a0", max_tokens=40, stream=True))
        while fake.stats.running == 0:
            await asyncio.sleep(0.01)
        status, body, _ = await complete(session, gw, "a1")
        assert status == 502 and body["error"]["code"] == "adapter_load_failed"
        assert "a1" in body["error"]["message"] and "busy" in body["error"]["message"]
        assert (await long)[0] == 200
        assert (await complete(session, gw, "a1"))[0] == 200  # a0 is idle now: it makes room


async def test_a_load_waiting_for_a_slot_lets_go_of_the_replica_for_other_loads(
        fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Both slots busy, a load of a0 waits for one. A request for a1, which the replica lists but this gateway's
    picture says it does not (as another worker's stale view can), counts as in flight on a1 while it waits for its
    own load, which needs the replica's lock: the waiting load lets go of the lock, so that request is served, a1
    frees, and a0 gets its slot (seen once in a full-suite run on real vLLM: a0 failed 'busy' after 60 s)."""
    fake = await fake_replica(itl_s=0.05)
    gw = await gateway_for([fake.url], lora=lora(max_loras=2, load_timeout_s=2))
    assert gw.gateway.adapters is not None
    holdings = gw.gateway.adapters.holdings
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(complete(session, gw, "a2", max_tokens=80, stream=True))  # 4 s: past the timeout
        short = asyncio.create_task(complete(session, gw, "a1", max_tokens=8, stream=True))
        while fake.stats.running < 2:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(complete(session, gw, "a0"))
        await asyncio.sleep(0.1)  # a0's load is waiting for a slot
        holdings.set_held(fake.url, "a1", False, time.time())  # the stale view
        stale = asyncio.create_task(complete(session, gw, "a1"))
        assert (await short)[0] == 200
        assert (await stale)[0] == 200
        status, body, _ = await waiting
        assert status == 200 and body["model"] == "a0", body
        assert (await long)[0] == 200
    assert ("unload", "a1") in fake.stats.lora_events and ("unload", "a2") not in fake.stats.lora_events


async def test_unknown_adapter_is_a_404_and_loses_nothing(fake_replica: FakeFactory,
                                                           gateway_for: GatewayFactory) -> None:
    """A name that is neither registered nor served: OpenAI-style 404, nothing loaded, others unaffected."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], lora=lora())
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(complete(session, gw, "../../etc/passwd"), complete(session, gw, "a0"),
                                       complete(session, gw, "fake-model"))
    (bad, error, _), (ok, _, _), (base, _, _) = results
    assert bad == 404 and error["error"]["code"] == "model_not_found" and error["error"]["param"] == "model"
    assert ok == 200 and base == 200
    assert loads(fake) == ["a0"]


async def test_failed_load_answers_every_waiter_502_not_500(fake_replica: FakeFactory,
                                                            gateway_for: GatewayFactory) -> None:
    """vLLM refuses the load: each waiting request gets a 502 that names the adapter; the base model still works."""
    fake = await fake_replica(lora_fail=True, lora_load_s=0.05)
    gw = await gateway_for([fake.url], lora=lora())
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(complete(session, gw, "a2") for _ in range(5)))
        assert {status for status, _, _ in answers} == {502}
        assert all(b["error"]["code"] == "adapter_load_failed" and "a2" in b["error"]["message"]
                   for _, b, _ in answers)
        assert (await complete(session, gw, "fake-model"))[0] == 200
        async with session.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert f'gateway_lora_load_failures_total{{adapter="a2",replica="{fake.url}"}} 1.0' in metrics


async def test_an_adapter_a_replica_lost_is_loaded_again(fake_replica: FakeFactory,
                                                         gateway_for: GatewayFactory) -> None:
    """A replica restarted between two syncs has lost its adapters while the gateway still counts them held: its
    404 for the adapter is not the client's answer. The gateway loads the adapter again and retries, streamed or
    not, without ejecting the replica; a base-model 404 (a name nobody serves) is still the client's."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], lora=lora())
    async with aiohttp.ClientSession() as session:
        assert (await complete(session, gw, "a0"))[0] == 200
        fake.stats.adapters.clear()  # restarted: vLLM starts with no adapter loaded
        status, body, _ = await complete(session, gw, "a0")
        assert status == 200 and body["model"] == "a0"
        fake.stats.adapters.clear()
        assert (await complete(session, gw, "a0", stream=True))[0] == 200
        assert (await complete(session, gw, "nobody-serves-this"))[0] == 404
        async with session.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert loads(fake) == ["a0", "a0", "a0"]
    assert gw.gateway.router.replicas[fake.url].healthy
    assert 'gateway_retries_total{reason="adapter_missing"} 2.0' in metrics


async def test_slow_load_times_out_with_504(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A load slower than load_timeout_s: 504, bounded."""
    fake = await fake_replica(lora_load_s=2.0)
    gw = await gateway_for([fake.url], lora=lora(load_timeout_s=0.2))
    async with aiohttp.ClientSession() as session:
        status, body, _ = await complete(session, gw, "a0")
    assert status in (502, 504) and body["error"]["code"] in ("adapter_load_timeout", "adapter_load_failed")


async def test_a_holder_wins_while_near_the_best(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """The adapter is on one replica: requests go there, not loaded elsewhere, while both are idle."""
    a, b = await fake_replica(), await fake_replica()
    gw = await gateway_for([a.url, b.url], lora=lora())
    async with aiohttp.ClientSession() as session:
        first = await complete(session, gw, "a0")
        served = {(await complete(session, gw, "a0"))[2] for _ in range(10)}
    assert served == {first[2]}
    assert loads(a) + loads(b) == ["a0"]


async def test_a_busy_holder_gets_the_adapter_loaded_on_the_best(fake_replica: FakeFactory,
                                                                  gateway_for: GatewayFactory) -> None:
    """The holder is far beyond the load bound: the adapter is loaded on the idle replica too."""
    a, b = await fake_replica(itl_s=0.01), await fake_replica(itl_s=0.01)
    gw = await gateway_for([a.url, b.url], lora=lora(slack_tokens=400))
    async with aiohttp.ClientSession() as session:
        _, _, holder = await complete(session, gw, "a0")
        busy = [asyncio.create_task(complete(session, gw, "a0", max_tokens=300, stream=True)) for _ in range(3)]
        while (a if holder == a.url else b).stats.running + (b if holder == a.url else a).stats.running < 3:
            await asyncio.sleep(0.01)
        # three long requests: the holder takes the first; once it is far busier the others load it elsewhere
        other = b if holder == a.url else a
        assert loads(other) == ["a0"]
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)


async def test_adapters_a_replica_lists_are_learned(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """An adapter loaded before the gateway started (listed in /v1/models with its parent) is not loaded again."""
    a, b = await fake_replica(), await fake_replica()
    b.stats.adapters["a3"] = "/adapters/a3"
    gw = await gateway_for([a.url, b.url], lora=lora())
    assert gw.gateway.adapters is not None
    await gw.gateway.adapters.sync(a.url)
    await gw.gateway.adapters.sync(b.url)
    async with aiohttp.ClientSession() as session:
        served = {(await complete(session, gw, "a3"))[2] for _ in range(5)}
    assert served == {b.url} and loads(a) + loads(b) == []


async def test_loads_and_unloads_are_counted_in_metrics(fake_replica: FakeFactory,
                                                        gateway_for: GatewayFactory) -> None:
    """/metrics counts each load and unload by replica and adapter."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], lora=lora(max_loras=1))
    async with aiohttp.ClientSession() as session:
        for model in ("a0", "a1", "a0"):
            assert (await complete(session, gw, model))[0] == 200
        async with session.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert f'gateway_lora_loads_total{{adapter="a0",replica="{fake.url}"}} 2.0' in metrics
    assert f'gateway_lora_unloads_total{{adapter="a1",replica="{fake.url}"}} 1.0' in metrics


async def test_two_workers_load_once_and_never_unload_under_each_other(fake_replica: FakeFactory,
                                                                        serve: ServeFactory) -> None:  # noqa: F811
    """`gateway serve --workers 2`: 16 concurrent requests for one adapter on fresh connections (both workers take
    some) cause one load; while a0 streams through one worker, loads of a1 and a2 through either never unload it;
    requests for four adapters at once through both never put more than max_loras on the replica."""
    fake = await fake_replica(itl_s=0.02, lora_load_s=0.2)
    gw = await serve([fake.url], workers=2, lora=lora(max_loras=2))
    body = {"model": "a1", "prompt": "hi", "max_tokens": 2}

    async def one(session: aiohttp.ClientSession, model: str) -> tuple[int, str]:
        async with session.post(gw.url + "/v1/completions", json={**body, "model": model},
                                headers={"Connection": "close"}) as resp:
            await resp.read()
            return resp.status, resp.headers.get("x-gateway-worker", "")

    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(one(session, "a1") for _ in range(16)))
        assert {status for status, _ in answers} == {200} and len({w for _, w in answers}) == 2
        assert loads(fake) == ["a1"]
        stream = {**body, "model": "a0", "max_tokens": 150, "stream": True}
        async with session.post(gw.url + "/v1/completions", json=stream) as long:
            await long.content.readline()
            for model in ("a2", "a1", "a2", "a1"):
                assert (await one(session, model))[0] == 200
                assert "a0" in fake.stats.adapters
            await long.read()
        assert ("unload", "a0") not in fake.stats.lora_events
        # four adapters at once through both workers: the replica never holds more than max_loras
        mixed = await asyncio.gather(*(one(session, f"a{i % 4}") for i in range(16)))
        assert {status for status, _ in mixed} == {200}
    assert fake.stats.max_adapters <= 2
    metrics = await gw.metrics()
    assert metrics[f"gateway_lora_loads_total{{adapter=a1}}{{replica={fake.url}}}"] >= 1


def test_holdings_are_shared_between_worker_rows() -> None:
    """What one worker loads, counts in flight and uses, another worker reads; the latest event wins."""
    table = LoadTable.create(rows=3)
    regions = lambda: [table.metric_region(r) for r in range(table.hi)]  # noqa: E731
    one = SharedHoldings(CounterStore(table.metric_region(1)), regions)
    two = SharedHoldings(CounterStore(table.metric_region(2)), regions)
    one.set_held("http://r", "a0", True, at=100.0)
    assert two.held("http://r", "a0")
    two.set_held("http://r", "a0", False, at=101.0)
    assert not one.held("http://r", "a0")
    one.set_held("http://r", "a0", True, at=100.5)  # older than the unload: changes nothing
    assert not two.held("http://r", "a0")
    one.add_inflight("http://r", "a0", 1)
    two.add_inflight("http://r", "a0", 2)
    assert one.inflight("http://r", "a0") == 3 and two.last_used("http://r", "a0") > 0
    one.forget_inflight(["http://r"], ["a0"])
    assert two.inflight("http://r", "a0") == 2


def test_config_registry() -> None:
    """Adapters are a name -> path map (or path and base); bad names and values are refused, naming them."""
    config = from_mapping({"replicas": ["http://r:1"],
                           "lora": {"adapters": {"sql": "/m/sql", "chat": {"path": "org/chat", "base": "m"}}}})
    assert config.lora.enabled and config.lora.registry()["chat"] == AdapterSpec("chat", "org/chat", "m")
    assert from_mapping(to_mapping(config)).lora == config.lora
    assert not from_mapping({"replicas": ["http://r:1"]}).lora.enabled
    with pytest.raises(ConfigError, match="adapter name"):
        LoraConfig(adapters={"../x": "/p"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'x'"):
        LoraConfig(adapters={"x": 3})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_loras"):
        LoraConfig(max_loras=0)
    with pytest.raises(ConfigError, match="unknown key"):
        from_mapping({"replicas": ["http://r:1"], "lora": {"adapter": {}}})


async def test_adapter_requests_wait_in_the_queue_order(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """One slot, held; a tenant queues eight base-model requests, then another tenant two adapter requests and an
    urgent adapter request comes: the queue's order (priority, then tokens served by tenant) places the adapter
    requests among the waiters as it places any other, instead of leaving them to find a free slot by chance."""
    fake = await fake_replica(itl_s=0.005)
    gw = await gateway_for([{"url": fake.url, "max_requests": 1}], queue={"max_size": 20, "max_wait_s": 10},
                           tenants={"fair": True, "header": "x-tenant"}, lora=lora(),
                           priority={"enabled": True, "bands": {"interactive": 0, "batch": 10}})
    async with aiohttp.ClientSession() as session:
        async def send(tenant: str, model: str, tag: str, tokens: int = 4, band: str = "batch") -> int:
            body = {"model": model, "prompt": tag, "max_tokens": tokens}
            async with session.post(gw.base_url + "/completions", json=body,
                                    headers={"x-tenant": tenant, "x-priority": band}) as resp:
                await resp.read()
                return resp.status
        assert await send("light", "a1", "load") == 200  # the adapter is loaded before the queue forms
        holder = asyncio.create_task(send("heavy", "fake-model", "holder", 100))  # 0.5 s: all queue behind it
        await asyncio.sleep(0.1)
        heavy = [asyncio.create_task(send("heavy", "fake-model", f"h{i}")) for i in range(8)]
        await asyncio.sleep(0.05)
        light = [asyncio.create_task(send("light", "a1", f"l{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        urgent = asyncio.create_task(send("heavy", "a1", "urgent", band="interactive"))
        statuses = await asyncio.gather(holder, *heavy, *light, urgent)
    assert statuses == [200] * 12
    prompts = [b["prompt"] for b in fake.stats.bodies][1:]  # after the adapter's first request
    assert prompts[:2] == ["holder", "urgent"], prompts  # the urgent one first, though it came last
    assert prompts.index("l0") <= 3 and prompts.index("l1") <= 5, prompts  # light interleaves with heavy
    assert gw.gateway.router.queue_depth == 0
    assert gw.gateway.adapters is not None and gw.gateway.adapters.holdings.inflight(fake.url, "a1") == 0


async def test_an_adapter_request_that_leaves_the_queue_gives_its_count_back(fake_replica: FakeFactory,
                                                                             gateway_for: GatewayFactory) -> None:
    """A queued adapter request whose client goes away, and one given a slot in the same moment it went: the
    adapter's count in flight (which keeps it from being unloaded) comes back to 0 either way, not below."""
    fake = await fake_replica(itl_s=0.005)
    gw = await gateway_for([{"url": fake.url, "max_requests": 1}], queue={"max_size": 20, "max_wait_s": 10},
                           lora=lora())
    assert gw.gateway.adapters is not None
    holdings, router = gw.gateway.adapters.holdings, gw.gateway.router
    async with aiohttp.ClientSession() as session:
        assert (await complete(session, gw, "a1"))[0] == 200
        holder = asyncio.create_task(complete(session, gw, "fake-model", max_tokens=40))
        await asyncio.sleep(0.1)
        gone = asyncio.create_task(complete(session, gw, "a1"))
        await until(lambda: router.queue_depth == 1)
        assert holdings.inflight(fake.url, "a1") == 1
        gone.cancel()
        await until(lambda: router.queue_depth == 0)
        assert (await holder)[0] == 200
    await until(lambda: holdings.inflight(fake.url, "a1") == 0)
    assert holdings.inflight(fake.url, "a1") == 0

    # given its lease by the queue, then cancelled before it ran: the lease gives the count back, once
    replica = router.replicas[fake.url]
    held = router.try_acquire(RequestInfo("fake-model", 1, 1, False))
    assert held is not None
    task = asyncio.create_task(gw.gateway.adapters.acquire(RequestInfo("a1", 1, 1, False)))
    await until(lambda: router.queue_depth == 1)
    held.release()  # the queue hands the waiter its lease (the future is set) ...
    task.cancel()  # ... and the request is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert holdings.inflight(replica.url, "a1") == 0
