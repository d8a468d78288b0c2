"""The simulator's automatic prefix caching (vLLM's APC): hashed 16-token blocks, hits cost no prefill, blocks
shared while in use and evicted least recently freed first; and multi-turn chats through the gateway's policies."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gateway.policies import make_policy
from sim.clock import VirtualClock
from sim.device import SharedDevice
from sim.engine import FINISHED, Engine, EngineConfig, SimRequest
from sim.fleet import Pinned, conversation_records, run_conversations
from sim.gpus import get_gpu
from sim.model import load_model
from sim.node import NodeSpec
from sim.steptime import StepTimeModel
from sim.workload import Conversation, Turn, block_hashes, conversations

MODEL = load_model("opt-1.3b")
GPU = get_gpu("H100-64GB")


def engine(blocks: int = 10_000, chunked: bool = False, caching: bool = True) -> tuple[VirtualClock, Engine]:
    clock = VirtualClock()
    config = EngineConfig(num_gpu_blocks=blocks, chunked_prefill=chunked, enable_prefix_caching=caching,
                          max_num_batched_tokens=8192 if chunked else 2048)
    return clock, Engine(config, StepTimeModel(MODEL, GPU), SharedDevice(clock), clock)


def seq(name: int, tokens: int) -> list[int]:
    """Block hashes of a sequence of `tokens` tokens of one segment."""
    return block_hashes([(name, tokens)], 16)


def ttft(clock: VirtualClock, eng: Engine, req: SimRequest) -> float:
    start = clock.now()
    eng.add(req)
    clock.run()
    assert req.state == FINISHED and req.first_token_at is not None
    return req.first_token_at - start


@pytest.mark.parametrize("chunked", [False, True])
def test_a_repeated_prompt_hits_all_but_its_last_block_and_prefills_faster(chunked: bool) -> None:
    """The second identical 1,600-token prompt finds 99 of its 100 blocks (vLLM recomputes at least one token)."""
    clock, eng = engine(chunked=chunked)
    blocks = seq(7, 1600 + 16)
    cold = ttft(clock, eng, SimRequest(1600, 16, blocks=blocks))
    warm_req = SimRequest(1600, 16, blocks=blocks)
    warm = ttft(clock, eng, warm_req)
    assert warm_req.cached_tokens == 99 * 16
    assert eng.prefix_cache_queries == 3200 and eng.prefix_cache_hits == 99 * 16
    # as vLLM counts them: vllm:prompt_tokens the whole prompts, vllm:prompt_tokens_cached the part found cached;
    # the tokens computed (prefill chunks) are the rest
    assert eng.prompt_tokens_received == 3200 and eng.prompt_tokens_cached == 99 * 16
    assert eng.prompt_tokens_total == 3200 - 99 * 16
    assert warm < cold / 2
    assert eng.used_blocks == 0


def test_caching_off_or_no_hashes_means_no_hits() -> None:
    for caching, blocks in ((False, seq(1, 512)), (True, None)):
        clock, eng = engine(caching=caching)
        for _ in range(2):
            req = SimRequest(500, 8, blocks=blocks)
            ttft(clock, eng, req)
            assert req.cached_tokens == 0
        assert eng.prefix_cache_hits == 0


def test_a_shared_head_hits_and_a_different_one_does_not() -> None:
    """Two prompts sharing a 256-token head: the second hits those 16 blocks only; another head hits none."""
    clock, eng = engine()
    first = block_hashes([(1, 256), (2, 300)], 16)
    second = block_hashes([(1, 256), (3, 300)], 16)
    other = block_hashes([(4, 256), (3, 300)], 16)
    ttft(clock, eng, SimRequest(556, 8, blocks=first))
    b = SimRequest(556, 8, blocks=second)
    ttft(clock, eng, b)
    c = SimRequest(556, 8, blocks=other)
    ttft(clock, eng, c)
    assert (b.cached_tokens, c.cached_tokens) == (256, 0)


def test_blocks_in_use_are_shared_and_all_come_back() -> None:
    """Twenty concurrent requests on one 800-token head hold its 50 blocks once; at the end none is in use."""
    clock, eng = engine()
    eng.add(SimRequest(800, 4, blocks=seq(9, 816)))
    clock.run()
    reqs = [SimRequest(800 + 32, 200, blocks=block_hashes([(9, 800), (100 + i, 32 + 200)], 16)) for i in range(20)]
    peak = []

    def probe() -> None:
        peak.append(eng.used_blocks)
        if eng.num_running:
            clock.call_at(clock.now() + 0.01, probe)

    for req in reqs:
        eng.add(req)
    clock.call_at(clock.now() + 0.05, probe)
    clock.run()
    assert all(r.cached_tokens == 800 for r in reqs)
    own = -(-(32 + 200) // 16) + 1  # each request's own blocks (its tail crosses one more boundary at most)
    assert max(peak) <= 50 + 20 * own
    assert eng.used_blocks == 0 and eng.cached_blocks > 50


def test_the_least_recently_freed_blocks_are_evicted_first() -> None:
    """A pool of 100 blocks: A, B, then C (about 40 blocks each) evict from A, its tail first (vLLM frees a
    request's blocks in reverse), so B hits whole and A only its head."""
    clock, eng = engine(blocks=100)
    a, b, c = seq(1, 640 + 16), seq(2, 640 + 16), seq(3, 640 + 16)
    for blocks in (a, b, c):
        ttft(clock, eng, SimRequest(640, 8, blocks=blocks))
    again_b, again_a = SimRequest(640, 8, blocks=b), SimRequest(640, 8, blocks=a)
    ttft(clock, eng, again_b)
    ttft(clock, eng, again_a)
    assert again_b.cached_tokens == 39 * 16
    assert 0 < again_a.cached_tokens <= 20 * 16
    assert eng.used_blocks == 0 and eng.cached_blocks <= 100


def test_a_preempted_request_finds_its_own_blocks_again() -> None:
    """Recompute preemption frees the blocks into the cache; the request's re-prefill hits them."""
    clock, eng = engine(blocks=200)
    reqs = [SimRequest(600, 1200, blocks=seq(50 + i, 1800)) for i in range(3)]
    for req in reqs:
        eng.add(req)
    clock.run()
    assert eng.num_preemptions > 0
    assert all(r.state == FINISHED and r.generated == r.max_tokens for r in reqs)
    assert any(r.preemptions and r.cached_tokens > 0 for r in reqs)
    assert eng.used_blocks == 0


def test_a_conversations_turns_are_prefixes_of_it() -> None:
    """Turn i's prompt and reply hash to a prefix of the whole chat; the system prompt's blocks are every chat's."""
    chat = Conversation(3, 0.0, 64, (Turn(40, 100), Turn(30, 50, 2.0), Turn(20, 10, 1.0)))
    records = conversation_records(chat)
    assert [r.prompt_tokens for r in records] == [104, 104 + 100 + 30, 234 + 50 + 20]
    assert [r.prefix_tokens for r in records] == [0, 140, 140 + 80]
    whole = chat.block_hashes()
    assert all(list(r.blocks or []) == whole[:len(r.blocks or [])] for r in records)
    other = Conversation(4, 0.0, 64, (Turn(40, 100),)).block_hashes()
    assert other[:4] == whole[:4] and other[4] != whole[4]
    assert len({r.prefix for r in records}) == 1


def test_affinity_keeps_chats_cached_and_load_only_routing_does_not() -> None:
    """150 chats on four replicas: prefix_affinity's hit rate is far above least_requests' and near the oracle's,
    and its p99 time to first token is no worse."""
    node = replace(NodeSpec(MODEL, GPU, 4, 64, 0.225), prefix_caching=True)
    chats = conversations(150, 3.0, np.random.default_rng(0))
    affinity = run_conversations(node, chats, "prefix_affinity")
    load_only = run_conversations(node, chats, "least_requests")
    oracle = run_conversations(node, chats, Pinned(make_policy("estimated_ttft")))
    assert affinity.completed == load_only.completed == sum(len(c.turns) for c in chats)
    assert affinity.hit_rate > load_only.hit_rate + 0.2
    assert affinity.hit_rate > oracle.hit_rate - 0.05
    assert affinity.ttft_p99 <= load_only.ttft_p99 * 1.05


def test_multi_turn_runs_need_the_prefix_cache() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        run_conversations(NodeSpec(MODEL, GPU, 2, 64, 0.45), conversations(2, 1.0, np.random.default_rng(0)),
                          "round_robin")
