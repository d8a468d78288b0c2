"""Memory per replica and replica count: pure functions over values."""

from __future__ import annotations

import pytest

from planner.errors import MemoryPlanError
from planner.memory import (GIB, MemoryFacts, cpu_kvcache_space_gib, gpu_layout, kv_bytes_for_batch,
                            measured_kv_bytes, replica_memory)
from planner.points import KvPool

OPT_1_3B_KV_PER_TOKEN = 2 * 2 * 2048 * 24  # fp16 x (K, V) x hidden x layers = 196608 bytes


def test_kv_for_batch_rounds_each_request_up_to_whole_blocks() -> None:
    """770 tokens take 49 blocks of 16, not 770/16 = 48.1."""
    assert kv_bytes_for_batch(1, 768, 1.0, 16) == 768
    assert kv_bytes_for_batch(1, 770, 1.0, 16) == 49 * 16
    assert kv_bytes_for_batch(10, 770, 2.0, 16) == 10 * 49 * 16 * 2


def test_opt_1_3b_kv_for_256_requests_of_768_tokens_is_36_gib() -> None:
    """256 x (512 in + 256 out) x 192 KiB/token = 36 GiB exactly."""
    assert kv_bytes_for_batch(256, 768, OPT_1_3B_KV_PER_TOKEN, 16) == 36 * GIB


def test_measured_kv_rounds_up_to_whole_blocks() -> None:
    """Peak usage 50.1% of 100 blocks is 51 blocks."""
    pool = KvPool(num_blocks=100, block_size=16, bytes=100 * 16 * 1000)
    assert measured_kv_bytes(0.5, pool, None) == 50 * 16 * 1000
    assert measured_kv_bytes(0.501, pool, None) == 51 * 16 * 1000
    assert measured_kv_bytes(0.5, KvPool(num_blocks=100, block_size=16), None) is None
    assert measured_kv_bytes(0.5, KvPool(num_blocks=100, block_size=16), 10.0) == 50 * 16 * 10


def test_measured_kv_wins_over_computed() -> None:
    """When the profile measured the peak, that is the KV figure, and the source says so."""
    facts = MemoryFacts(weights_bytes=GIB, overhead_bytes=0, margin=0.0, kv_bytes_per_token=1000.0,
                        tokens_per_request=100, measured_kv_bytes=5 * GIB)
    memory = replica_memory(facts, 64)
    assert memory.kv_bytes == 5 * GIB
    assert memory.kv_source.startswith("measured")
    assert memory.total_bytes == 6 * GIB


def test_margin_is_a_fraction_of_the_whole_slice() -> None:
    """A 10% margin on 2 GiB weights + 36 GiB KV + 1 GiB overhead is 3.9 GiB."""
    facts = MemoryFacts(weights_bytes=2 * GIB, overhead_bytes=GIB, margin=0.1,
                        kv_bytes_per_token=OPT_1_3B_KV_PER_TOKEN, tokens_per_request=768)
    memory = replica_memory(facts, 256)
    assert memory.kv_bytes == 36 * GIB
    assert memory.margin_bytes == pytest.approx(3.9 * GIB, abs=1)
    assert memory.total_bytes == pytest.approx(42.9 * GIB, abs=1)


def test_missing_kv_facts_name_the_flags() -> None:
    """Without a measured peak or the facts to compute one, the error names the missing flags."""
    with pytest.raises(MemoryPlanError, match="--kv-bytes-per-token and --tokens-per-request"):
        replica_memory(MemoryFacts(weights_bytes=GIB, overhead_bytes=0), 8)


def test_two_slices_of_the_paper_fit_and_share_the_usable_memory() -> None:
    """Slices of 24 GiB on a 64 GiB card: two fit in 57.6 GiB usable, each gets 0.9 / 2 = 0.45."""
    facts = MemoryFacts(weights_bytes=24 * GIB, overhead_bytes=0, margin=0.0, measured_kv_bytes=0)
    layout = gpu_layout(replica_memory(facts, 256), 64 * GIB, usable_fraction=0.9)
    assert (layout.replicas, layout.fit, layout.fraction_each) == (2, 2, 0.45)
    assert layout.needed_fraction == 0.375


def test_replica_count_can_be_capped_or_asked_for() -> None:
    """--max-replicas caps the count; --replicas asks for an exact count that must fit."""
    memory = replica_memory(MemoryFacts(weights_bytes=GIB, overhead_bytes=0, margin=0.0, measured_kv_bytes=0), 8)
    assert gpu_layout(memory, 10 * GIB, 1.0).replicas == 10
    capped = gpu_layout(memory, 10 * GIB, 1.0, max_replicas=4)
    assert (capped.replicas, capped.fraction_each) == (4, 0.25)
    assert gpu_layout(memory, 10 * GIB, 1.0, replicas=3).fraction_each == 0.3333
    with pytest.raises(MemoryPlanError, match="11 replicas were asked for but only 10 fit"):
        gpu_layout(memory, 10 * GIB, 1.0, replicas=11)


def test_a_slice_bigger_than_the_device_is_a_clear_error() -> None:
    """When not even one replica fits, the error gives both sizes and what to change."""
    memory = replica_memory(MemoryFacts(weights_bytes=70 * GIB, overhead_bytes=0, margin=0.0,
                                        measured_kv_bytes=0), 256)
    with pytest.raises(MemoryPlanError, match=r"one replica needs 70.0 GiB at B=256 but only 57.6 GiB"):
        gpu_layout(memory, 64 * GIB)


def test_cpu_kv_space_is_whole_gib_with_margin_and_at_least_one() -> None:
    """vLLM's CPU KV space is an integer number of GiB: round up after the margin."""
    assert cpu_kvcache_space_gib(GIB // 10, 0.1) == 1
    assert cpu_kvcache_space_gib(GIB, 0.0) == 1
    assert cpu_kvcache_space_gib(GIB, 0.1) == 2
    assert cpu_kvcache_space_gib(0, 0.1) == 1


def test_computed_kv_wins_when_the_sampled_peak_is_lower() -> None:
    """A sampled peak below what B* full-length requests hold is not trusted: the computed need is used."""
    facts = MemoryFacts(weights_bytes=0, overhead_bytes=0, margin=0.0, kv_bytes_per_token=1000.0,
                        tokens_per_request=100, block_size=16, measured_kv_bytes=1000)
    memory = replica_memory(facts, 8)
    assert memory.kv_bytes == 8 * 112 * 1000  # 100 tokens -> 7 blocks of 16
    assert memory.kv_source.startswith("computed") and "1000 bytes measured" in memory.kv_source
