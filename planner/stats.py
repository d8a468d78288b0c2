"""Summaries of a run's requests: throughput and latency statistics (pure functions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.client import LoadResult
from planner.points import Latency


def latency_ms(values_s: Sequence[float]) -> Latency:
    """Mean, p50 and p99 of durations given in seconds, in milliseconds (all None when there are none)."""
    if not values_s:
        return Latency()
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return Latency(mean=round(float(ms.mean()), 3), p50=round(float(np.percentile(ms, 50)), 3),
                   p99=round(float(np.percentile(ms, 99)), 3))


@dataclass(frozen=True)
class RunSummary:
    """What one run measured, ready to become a `ProfilePoint` or a validation row."""

    num_requests: int
    failed_requests: int
    duration_s: float
    req_s: float
    output_tok_s: float
    total_tok_s: float
    mean_input_tokens: float
    ttft_ms: Latency
    tpot_ms: Latency
    itl_ms: Latency
    e2e_ms: Latency


def summarize(load: LoadResult) -> RunSummary:
    """Throughput over the wall time of the run; latencies over the requests that succeeded."""
    ok = [r for r in load.results if r.ok]
    duration = load.duration_s
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)

    def rate(n: float) -> float:
        return round(n / duration, 3) if duration > 0 else 0.0

    return RunSummary(
        num_requests=len(load.results), failed_requests=len(load.results) - len(ok), duration_s=round(duration, 3),
        req_s=rate(len(ok)), output_tok_s=rate(output), total_tok_s=rate(output + prompt),
        mean_input_tokens=round(prompt / len(ok), 1) if ok else 0.0,
        ttft_ms=latency_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=latency_ms([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=latency_ms([g for r in ok for g in r.gaps_s]),
        e2e_ms=latency_ms([r.e2e_s for r in ok]))
