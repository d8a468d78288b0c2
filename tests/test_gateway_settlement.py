"""Tenants charged by the tokens served: the output budget an answer did not use comes back (gateway/settlement.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.config import TenantsConfig
from gateway.fairqueue import PriorityOrder
from gateway.parsing import RequestInfo
from gateway.ratelimit import TokenRates
from gateway.settlement import Settlement, completion_tokens
from gateway.tokens import estimate
from tests.conftest import FakeFactory, GatewayFactory


@pytest.mark.parametrize("body, tokens", [
    (b'{"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}}', 5),
    (b'{"choices": [{"text": "x"}]}', None),  # no usage
    (b'{"usage": null}', None),
    (b'not json', None),
    (b'[1, 2]', None),
    (b'{"usage": {"completion_tokens": "five"}}', None),
])
def test_completion_tokens_from_an_answer(body: bytes, tokens: int | None) -> None:
    assert completion_tokens(body) == tokens


def info(tenant: str, prompt: int = 10, budget: int = 100) -> RequestInfo:
    return RequestInfo("m", prompt, budget, False, tenant=tenant)


def test_a_lease_gives_back_its_unused_budget_and_a_failed_one_all_of_it() -> None:
    order = PriorityOrder(fair=True)
    settlement = Settlement(order, None)
    a = info("a")
    order.charge(a)
    order.charge(a)  # two leases: the first failed before an answer, the second got 30 tokens
    settlement.lease_done(a, None)
    settlement.lease_done(a, 30)
    assert order.counters["a"] == 10 + 30  # what one lease served: its prompt and its 30 tokens


def test_a_request_gives_its_bucket_back_what_it_did_not_use() -> None:
    now = [0.0]
    rates = TokenRates(TenantsConfig(tokens_per_s=1, burst=300), clock=lambda: now[0])
    settlement = Settlement(None, rates)
    for served in (5, None, 5, 5, 5):  # each takes 110; without the settlement the third would be refused
        rates.take(info("a"))
        settlement.request_done(info("a"), served)  # None: refused by the gateway, all 110 come back
    assert rates._buckets["a"].level == pytest.approx(300 - 4 * (10 + 5))


async def test_short_answers_are_charged_what_they_got(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A tenant asking for 40 tokens and getting 5 is charged 5 (plus its prompt), streamed or not: at a rate of
    1 token/s with bursts of 100, five such requests in a row all pass, where each charged its 40 would see the
    third refused; its virtual token counter ends at what it was served."""
    fake = await fake_replica(stop_after=5)
    gw = await gateway_for([fake.url], tenants={"fair": True, "tokens_per_s": 1, "burst": 100, "header": "x-tenant"})
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as client:
        def send(stream: bool) -> Any:
            return client.post("/completions", headers={"x-tenant": "a"},
                               json={"model": "fake-model", "prompt": "hi", "max_tokens": 40, "stream": stream})
        answers = [await send(stream) for stream in (False, True, False, True, False)]
    assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
    # three whole answers of 5 tokens (their usage), two streams of 5 token events and [DONE], five prompts
    assert gw.gateway.router.order.counters["a"] == 3 * 5 + 2 * 6 + 5 * estimate("hi")  # type: ignore[union-attr]


async def test_a_request_no_replica_answers_takes_nothing_from_its_bucket(fake_replica: FakeFactory,
                                                                          gateway_for: GatewayFactory) -> None:
    """Refused with 503 (the only replica answers 503, retried to the end): the tokens taken come back."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], tenants={"tokens_per_s": 1, "burst": 100, "header": "x-tenant"},
                           retry={"max_attempts": 2, "max_time_s": 5})
    fake.behavior.fail = "refuse"
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as client:
        for _ in range(4):  # 4 x 42 tokens: past the burst, if they were kept
            answer = await client.post("/completions", headers={"x-tenant": "a"},
                                       json={"model": "fake-model", "prompt": "hi", "max_tokens": 40})
            assert answer.status_code in (502, 503), answer.text
    assert gw.gateway._rates._buckets["a"].level > 100 - 42  # type: ignore[union-attr]


async def test_a_retried_request_is_charged_once(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A lease whose replica refused (503, retried on the other) gives back all it was charged: the tenant's
    counter holds each request once, at what it was served."""
    refusing, serving = await fake_replica(fail="refuse"), await fake_replica(stop_after=5)
    gw = await gateway_for([refusing.url, serving.url], tenants={"fair": True, "header": "x-tenant"},
                           retry={"max_attempts": 2, "max_time_s": 5}, health={"interval_s": 60, "timeout_s": 1})
    sent = 0
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as client:
        while not refusing.stats.bodies and sent < 20:  # until one went to the refusing replica first
            answer = await client.post("/completions", headers={"x-tenant": "a"},
                                       json={"model": "fake-model", "prompt": f"p{sent}", "max_tokens": 40})
            assert answer.status_code == 200, answer.text
            sent += 1
            gw.gateway.router.replicas[refusing.url].healthy = True  # ejected by its 503: back, to be picked again
    assert refusing.stats.bodies, "no request was tried on the refusing replica first"
    counter = gw.gateway.router.order.counters["a"]  # type: ignore[union-attr]
    assert counter == sum(5 + estimate(f"p{i}") for i in range(sent))


async def test_adapter_requests_are_charged_and_settled(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A LoRA adapter's requests (their leases taken by gateway/lora.py, not the router's queue) count in their
    tenant's virtual token counter as the base model's do: what they were served, plus their prompts."""
    fake = await fake_replica(stop_after=5)
    gw = await gateway_for([fake.url], tenants={"fair": True, "header": "x-tenant"},
                           lora={"adapters": {"a1": "/adapters/a1"}, "max_loras": 2, "sync_s": 60})
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as client:
        for model, stream in (("a1", False), ("a1", True), ("fake-model", False)):
            answer = await client.post("/completions", headers={"x-tenant": "a"},
                                       json={"model": model, "prompt": "hi", "max_tokens": 40, "stream": stream})
            assert answer.status_code == 200, answer.text
    assert fake.stats.adapters == {"a1": "/adapters/a1"}
    assert gw.gateway.router.order.counters["a"] == 5 + 6 + 5 + 3 * estimate("hi")  # type: ignore[union-attr]
