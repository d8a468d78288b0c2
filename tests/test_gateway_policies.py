"""Routing policies: least-outstanding-tokens keeps short requests away from a replica busy with a long one."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from gateway.affinity import key_hash
from gateway.config import ReplicaConfig
from gateway.parsing import RequestInfo
from gateway.policies import POLICIES, EstimatedTtft, make_policy
from gateway.replicas import Replica
from gateway.speed import DEFAULT_SPEED, Speed
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
    assert set(POLICIES) == {"prefix_affinity", "estimated_ttft", "least_outstanding_tokens", "round_robin", "random",
                             "least_requests", "power_of_two", "consistent_hash"}


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


# -- estimated_ttft -----------------------------------------------------------------------------------------------
def loaded(outstanding: int, inflight: int, prefill: int = 0, cap: int | None = 8, speed: Speed | None = None,
           name: str = "r", weight: float = 1.0) -> Replica:
    """A replica with a given load: tokens outstanding (prefill of them not started), requests in flight."""
    r = Replica(ReplicaConfig(url=f"http://{name}:1", max_num_seqs=cap, speed=speed, weight=weight))
    r.outstanding, r.inflight, r.prefill = outstanding, inflight, prefill
    return r


def test_estimated_ttft_takes_free_batch_slots_over_fewer_tokens() -> None:
    """One long request (2,000 tokens, 7 free slots) beats eight short ones filling the batch cap: LOT picks wrong."""
    long_one = loaded(2000, 1, name="long")
    full = loaded(400, 8, name="full")
    assert make_policy("estimated_ttft").pick([long_one, full], SHORT) is long_one
    assert make_policy("least_outstanding_tokens").pick([long_one, full], SHORT) is full


def test_estimated_ttft_weighs_the_output_ahead_when_every_slot_is_taken() -> None:
    """Both batches full and one request waiting on each: the one whose requests are nearly done frees a slot first."""
    nearly_done = loaded(9 * 10, 9, name="nearly-done")
    long_running = loaded(9 * 500, 9, name="long-running")
    assert make_policy("estimated_ttft").pick([long_running, nearly_done], SHORT) is nearly_done
    assert EstimatedTtft.estimate(long_running, 10) > 10 * EstimatedTtft.estimate(nearly_done, 10)


def test_estimated_ttft_avoids_a_prefill_backlog() -> None:
    """Prompts not yet started (8,000 tokens: 40 ms at 200,000 tokens/s) keep a replica out of the eligible set."""
    busy = loaded(8100, 2, prefill=8000, name="busy")
    idle = loaded(3000, 3, name="idle")
    assert make_policy("estimated_ttft").pick([busy, idle], SHORT) is idle
    assert EstimatedTtft.estimate(busy, 10) - EstimatedTtft.estimate(idle, 10) == pytest.approx(0.04, rel=0.05)


def test_estimated_ttft_chooses_by_tokens_among_replicas_near_the_best() -> None:
    """Two replicas with free slots and no backlog are both near the best: the fewer outstanding tokens wins."""
    more = loaded(900, 2, name="more")
    fewer = loaded(300, 3, name="fewer")
    policy = make_policy("estimated_ttft")
    assert all(policy.pick([more, fewer], SHORT) is fewer for _ in range(4))


def test_estimated_ttft_uses_each_replicas_speed() -> None:
    """A replica with five times slower steps and prefill looks five times slower at the same load."""
    slow_speed = Speed(tuple((b, 5 * s) for b, s in DEFAULT_SPEED.step_s), DEFAULT_SPEED.prefill_tokens_s / 5)
    slow = loaded(100, 8, speed=slow_speed, name="slow")
    fast = loaded(100, 8, name="fast")
    assert EstimatedTtft.estimate(slow, 10) == pytest.approx(5 * EstimatedTtft.estimate(fast, 10))
    assert make_policy("estimated_ttft").pick([slow, fast], SHORT) is fast


def test_the_admission_cap_stands_in_for_an_unknown_batch_cap() -> None:
    """With no max_num_seqs, max_requests is the batch cap; with neither, no slot wait is ever estimated."""
    r = Replica(ReplicaConfig(url="http://r:1", max_requests=4))
    r.outstanding, r.inflight = 4000, 6
    uncapped = loaded(4000, 6, cap=None)
    assert EstimatedTtft.estimate(r, 10) > 10 * EstimatedTtft.estimate(uncapped, 10)


# -- prefix_affinity ----------------------------------------------------------------------------------------------
def pool_of(n: int) -> list[Replica]:
    return [loaded(0, 0, name=f"r{i}") for i in range(n)]


def turn(prefix: int, history: int = 500, prompt: int = 600) -> RequestInfo:
    return RequestInfo("m", prompt, 100, True, prefix, history)


def test_a_conversation_stays_on_one_replica_and_conversations_spread() -> None:
    """Later turns of one key land on one replica whatever the order of the pool; 400 keys use every replica."""
    pool = pool_of(4)
    policy = make_policy("prefix_affinity")
    homes = {policy.pick(pool, turn(key_hash(str(k).encode()))).url for k in range(400)}
    assert homes == {r.url for r in pool}
    key = key_hash(b"conversation")
    first = policy.pick(pool, turn(key))
    assert all(policy.pick(order, turn(key)) is first for order in (pool[::-1], pool[1:] + pool[:1]))


def test_affinity_gives_way_when_its_replica_is_far_slower_than_the_best() -> None:
    """The key's replica takes the turn while within twice the best estimate, not when its batch is full."""
    pool = pool_of(3)
    policy = make_policy("prefix_affinity")
    key = key_hash(b"c")
    home = policy.pick(pool, turn(key))
    home.outstanding, home.inflight = 3000, 6  # some load: still within the bound
    assert policy.pick(pool, turn(key)) is home
    home.outstanding, home.inflight, home.prefill = 60_000, 40, 20_000  # batch full and a backlog: past it
    assert policy.pick(pool, turn(key)) is not home
    second = policy.pick(pool, turn(key))
    assert policy.pick(pool, turn(key)) is second  # the overflow also goes to one place: the next in rank


def test_a_first_turn_is_routed_by_load_alone() -> None:
    """Nothing is cached for a first turn (no history): it goes where estimated_ttft sends it."""
    pool = [loaded(5000, 4, name="a"), loaded(100, 1, name="b"), loaded(2000, 2, name="c")]
    policy = make_policy("prefix_affinity")
    assert all(policy.pick(pool, turn(key_hash(str(k).encode()), history=0)) is pool[1] for k in range(20))


def test_the_ranking_is_the_same_in_every_process() -> None:
    """Other gateway processes (another hash seed) send a key to the same replica: no per-process state or salt."""
    code = ("from gateway.affinity import key_hash; from gateway.parsing import RequestInfo; "
            "from gateway.policies import make_policy; from tests.test_gateway_policies import pool_of, turn; "
            "p = make_policy('prefix_affinity'); "
            "print(' '.join(p.pick(pool_of(5), turn(key_hash(str(k).encode()))).url for k in range(50)))")
    here = make_policy("prefix_affinity")
    expected = " ".join(here.pick(pool_of(5), turn(key_hash(str(k).encode()))).url for k in range(50))
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                             env={**os.environ, "PYTHONHASHSEED": seed}, cwd=Path(__file__).resolve().parent.parent)
        assert out.stdout.strip() == expected


def test_keys_move_only_off_a_replica_that_leaves() -> None:
    """Rendezvous hashing: removing one replica of five moves only the keys that were on it."""
    pool = pool_of(5)
    policy = make_policy("prefix_affinity")
    keys = [key_hash(str(k).encode()) for k in range(300)]
    before = {k: policy.pick(pool, turn(k)).url for k in keys}
    after = {k: policy.pick(pool[:2] + pool[3:], turn(k)).url for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == pool[2].url} and moved


def test_affinity_bounds_the_load_in_tokens_too() -> None:
    """The key's replica keeps the turn while its outstanding tokens exceed the least loaded's by at most 8 x the
    tokens its cache saves (500 here), free batch slots or not."""
    pool = pool_of(3)
    policy = make_policy("prefix_affinity")
    key = key_hash(b"bounded")
    home = policy.pick(pool, turn(key))
    home.outstanding, home.inflight = 3900, 4
    assert policy.pick(pool, turn(key)) is home
    home.outstanding = 4100
    assert policy.pick(pool, turn(key)) is not home
