"""A replica's speed for the gateway, from a profile: decode step time at each batch size, prefill tokens/s.

`planner plan` writes it into each replica of the plan (`speed:`), and `deploy up` hands it to the gateway, whose
`estimated_ttft` and `prefix_affinity` policies turn outstanding tokens into seconds with it (gateway/speed.py).

- step time at batch B: the point's median time per output token (its mean when the median is missing), measured
  with B requests in flight and a batch cap of B, so every sequence decodes at every step;
- prefill tokens/s: the profile's prompt tokens over the median time to first token of its smallest batch size, less
  one step (at concurrency B = batch cap no request waits for a slot, so that time is its own prefill and one step).
"""

from __future__ import annotations

from typing import Any

from planner.points import Profile


def gateway_speed(profile: Profile) -> dict[str, Any] | None:
    """The `speed` mapping for the gateway, or None when the profile has no time per output token."""
    steps = {}
    for point in profile.points:
        tpot = point.tpot_ms.p50 or point.tpot_ms.mean
        if tpot:
            steps[point.batch_size] = round(tpot / 1000, 6)
    if not steps:
        return None
    speed: dict[str, Any] = {"step_s": steps}
    first = profile.points[0]
    prompt = profile.context.workload.input_tokens
    ttft = first.ttft_ms.p50 or first.ttft_ms.mean
    if prompt and ttft and first.batch_size in steps:
        prefill_s = ttft / 1000 - steps[first.batch_size]
        if prefill_s > 0:
            speed["prefill_tokens_s"] = round(prompt / prefill_s, 1)
    return speed
