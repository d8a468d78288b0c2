"""The gateway's speed model from a profile: step time per batch size and prefill tokens/s, into the plan and on
to the gateway's config."""

from __future__ import annotations

import pytest

from deploy.launch import gateway_config
from gateway.config import from_mapping
from planner.planning import PlanConfig, make_plan
from planner.points import Latency, Profile, ProfileContext, ProfilePoint, Workload
from planner.speed import gateway_speed


def profile(with_ttft: bool = True) -> Profile:
    points = tuple(ProfilePoint(batch_size=b, total_tok_s=1000.0 * b, tpot_ms=Latency(mean=tpot + 0.5, p50=tpot),
                                ttft_ms=Latency(p50=24.0 if with_ttft else None))
                   for b, tpot in ((2, 4.0), (8, 5.0), (32, 9.0)))
    return Profile(points, ProfileContext(model="m", device="cpu", workload=Workload("fixed", 512, 256),
                                          cpu_kvcache_space_gib=1.0))


def test_steps_from_median_tpot_and_prefill_from_the_smallest_batch() -> None:
    """Step time is the median TPOT at each B; prefill is 512 prompt tokens in 24 ms less one 4 ms step."""
    speed = gateway_speed(profile())
    assert speed == {"step_s": {2: 0.004, 8: 0.005, 32: 0.009}, "prefill_tokens_s": pytest.approx(512 / 0.020)}
    assert "prefill_tokens_s" not in (gateway_speed(profile(with_ttft=False)) or {})


def test_the_plan_carries_the_speed_and_batch_cap_to_the_gateway() -> None:
    """`planner plan` writes the speed into each replica; deploy's gateway config passes it and max_num_seqs on."""
    plan = make_plan(profile(), PlanConfig(device="cpu", replicas=2, kv_bytes_per_token=36864))
    assert all(r.speed == gateway_speed(profile()) for r in plan.replicas)
    config = from_mapping(gateway_config(plan))
    assert config.policy == "prefix_affinity"
    for replica, spec in zip(config.replicas, plan.replicas):
        assert replica.max_num_seqs == spec.max_num_seqs and replica.speed is not None
        assert replica.speed.step(8) == 0.005
