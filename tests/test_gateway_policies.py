"""Routing policies: least-outstanding-tokens keeps short requests away from a replica busy with a long one."""

from __future__ import annotations

import random
from collections import Counter

import aiohttp
import pytest

from gateway.config import ReplicaConfig
from gateway.parsing import RequestInfo
from gateway.policies import POLICIES, make_policy
from gateway.replicas import Replica
from tests.conftest import FakeFactory, GatewayFactory


def replicas(*loads: tuple[int, int], weights: tuple[float, ...] | None = None) -> list[Replica]:
    out = []
    for i, (outstanding, inflight) in enumerate(loads):
        r = Replica(ReplicaConfig(url=f"http://r{i}:1", weight=(weights or (1.0,) * len(loads))[i]))
        r.outstanding, r.inflight = outstanding, inflight
        out.append(r)
    return out


SHORT = RequestInfo("m", 10, 10, True)


def test_least_outstanding_tokens_avoids_the_long_request() -> None:
    """One long request (2,000 tokens) outweighs three short ones (60 tokens) under token counting."""
    pool = replicas((2000, 1), (60, 3))
    assert make_policy("least_outstanding_tokens").pick(pool, SHORT) is pool[1]
    assert make_policy("least_requests").pick(pool, SHORT) is pool[0]


def test_capacity_weights_scale_the_comparison() -> None:
    """A replica with twice the capacity carries twice the tokens at the same relative load."""
    pool = replicas((1500, 3), (1000, 2), weights=(2.0, 1.0))
    assert make_policy("least_outstanding_tokens").pick(pool, SHORT) is pool[0]


def test_ties_are_shared_round_the_pool() -> None:
    """An idle pool spreads sequential requests instead of always picking the first replica."""
    pool = replicas((0, 0), (0, 0), (0, 0))
    policy = make_policy("least_outstanding_tokens")
    assert {policy.pick(pool, SHORT).url for _ in range(3)} == {r.url for r in pool}


def test_power_of_two_picks_the_lighter_of_two() -> None:
    """Power of two never picks the busiest of two replicas."""
    pool = replicas((5000, 1), (10, 1))
    policy = make_policy("power_of_two", random.Random(0))
    assert all(policy.pick(pool, SHORT) is pool[1] for _ in range(20))


def test_random_and_round_robin_use_every_replica() -> None:
    """Random and round robin reach every candidate."""
    pool = replicas((0, 0), (100, 1), (200, 2))
    for name in ("random", "round_robin"):
        policy = make_policy(name, random.Random(1))
        assert {policy.pick(pool, SHORT).url for _ in range(50)} == {r.url for r in pool}
    assert set(POLICIES) == {"least_outstanding_tokens", "round_robin", "random", "least_requests", "power_of_two"}


@pytest.mark.parametrize(("policy", "short_on_busy"), [("least_outstanding_tokens", 0), ("round_robin", 5)])
async def test_short_requests_avoid_a_replica_busy_with_a_long_one(
        policy: str, short_on_busy: int, fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Through the gateway: with one long stream in flight, LOT sends no short request to its replica; RR sends half."""
    fakes = [await fake_replica(itl_s=0.01), await fake_replica(itl_s=0.01)]
    gw = await gateway_for([f.url for f in fakes], policy=policy)
    async with aiohttp.ClientSession() as session:
        long = await session.post(gw.base_url + "/completions",
                                  json={"model": "fake-model", "prompt": "long", "max_tokens": 2000, "stream": True})
        await long.content.readany()
        busy = long.headers["x-gateway-replica"]
        served = Counter()
        for _ in range(10):
            async with session.post(gw.base_url + "/completions",
                                    json={"model": "fake-model", "prompt": "short", "max_tokens": 5}) as resp:
                served[resp.headers["x-gateway-replica"]] += 1
        long.close()
    assert served[busy] == short_on_busy
