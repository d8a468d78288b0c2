"""Several models behind one gateway: each model's own policy and admission queue (`models:` in the config)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from gateway.config import ConfigError, from_mapping, to_mapping
from gateway.policies import LeastOutstandingTokens, RoundRobin
from tests.conftest import FakeFactory, GatewayFactory


def test_models_section_is_read_and_round_trips() -> None:
    """`models:` maps a model to its policy and queue; to_mapping (how workers get the config) keeps it."""
    config = from_mapping({"replicas": ["http://127.0.0.1:9"], "models": {
        "chat": {"policy": "round_robin", "queue": {"max_size": 3, "max_wait_s": 2}}, "embed": {}}})
    models = config.model_map()
    assert models["chat"].policy == "round_robin" and models["chat"].queue is not None
    assert models["chat"].queue.max_size == 3 and models["embed"].policy is None
    assert from_mapping(to_mapping(config)).model_map() == models


@pytest.mark.parametrize("models, message", [
    ({"chat": {"policy": "fastest"}}, "policy 'fastest'"),
    ({"chat": {"queue": {"max_size": -1}}}, "queue.max_size"),
    ({"chat": {"weight": 2}}, "unknown key(s) in models: chat: weight"),
    (["chat"], "models must map model names"),
])
def test_bad_models_section_names_the_problem(models: object, message: str) -> None:
    """A bad per-model setting is a ConfigError that names it."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_mapping({"replicas": ["http://127.0.0.1:9"], "models": models})


async def test_each_model_routes_with_its_own_policy(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Two replicas per model: `a` round-robins (strictly alternates), `b` uses the gateway's default."""
    a1, a2 = await fake_replica(model="a"), await fake_replica(model="a")
    b1, b2 = await fake_replica(model="b"), await fake_replica(model="b")
    gw = await gateway_for([a1.url, a2.url, b1.url, b2.url], policy="least_outstanding_tokens",
                           models={"a": {"policy": "round_robin"}})
    router = gw.gateway.router
    assert isinstance(router.model_policies["a"], RoundRobin) and "b" not in router.model_policies
    assert isinstance(router.policy, LeastOutstandingTokens)
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        for _ in range(4):
            await client.completions.create(model="a", prompt="x", max_tokens=1)
        await client.embeddings.create(model="b", input="y")
    assert len(a1.stats.bodies) == len(a2.stats.bodies) == 2
    assert len(b1.stats.bodies) + len(b2.stats.bodies) == 1


async def test_a_models_queue_is_its_own(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Model `a` (queue of 1) is full: its next request gets 429 while `b` still queues in the shared queue."""
    a = await fake_replica(model="a", ttft_s=0.5)
    b = await fake_replica(model="b", ttft_s=0.5)
    replicas = [{"url": a.url, "max_requests": 1}, {"url": b.url, "max_requests": 1}]
    gw = await gateway_for(replicas, queue={"max_size": 8, "max_wait_s": 5},
                           models={"a": {"queue": {"max_size": 1, "max_wait_s": 5}}})
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0) as client:
        def call(model: str) -> asyncio.Task[object]:
            return asyncio.create_task(client.completions.create(model=model, prompt="x", max_tokens=1))
        running_a, queued_a = call("a"), None
        await asyncio.sleep(0.1)
        queued_a = call("a")
        await asyncio.sleep(0.1)
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="a", prompt="x", max_tokens=1)
        b_tasks = [call("b") for _ in range(3)]  # one runs, two wait in the shared queue
        await asyncio.gather(running_a, queued_a, *b_tasks)
    assert len(a.stats.bodies) == 2 and len(b.stats.bodies) == 3
