"""Summaries of a run's requests: throughput and latency statistics (pure functions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.client import LoadResult, RequestResult
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
    steady_tok_s: float | None = None  # tokens/s while all `concurrency` were in flight, the fill left out
    steady_s: float | None = None  # how long that window was
    client_cores: float | None = None  # CPU seconds of the client processes over the run's wall time, if known


def steady_window(load: LoadResult) -> tuple[float, float] | None:
    """The part of a closed-loop run where it ran at full concurrency past its fill: from the first successful
    request's end (the first wave's prefills and decodes are under way by then) to the last request's start
    (after it, fewer and fewer are in flight). None when the run had no more requests than its concurrency, so
    no such part."""
    ok = [r for r in load.results if r.ok]
    if len(load.results) <= load.concurrency or not ok:
        return None
    begin, end = min(r.end for r in ok), max(r.start for r in load.results)
    return (begin, end) if end > begin else None


def tokens_between(results: Sequence[RequestResult], begin: float, end: float) -> float:
    """Tokens the successful requests produced in [begin, end): each prompt when its first token arrived, each
    output token with its chunk (a chunk of several tokens carries an equal share of the request's output)."""
    total = 0.0
    for r in results:
        if not r.ok or r.ttft_s is None:
            continue
        t = r.start + r.ttft_s
        share = r.output_tokens / (len(r.gaps_s) + 1)
        total += (r.prompt_tokens + share) if begin <= t < end else 0.0
        for gap in r.gaps_s:
            t += gap
            if begin <= t < end:
                total += share
    return total


def steady_rate(load: LoadResult) -> tuple[float | None, float | None]:
    """Tokens/s over `steady_window` and its length in seconds (None, None: no window)."""
    window = steady_window(load)
    if window is None:
        return None, None
    begin, end = window
    return round(tokens_between(load.results, begin, end) / (end - begin), 3), round(end - begin, 3)


def summarize(load: LoadResult) -> RunSummary:
    """Throughput over the wall time of the run, and over its steady part (`steady_window`); latencies over the
    requests that succeeded."""
    ok = [r for r in load.results if r.ok]
    duration = load.duration_s
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)

    def rate(n: float) -> float:
        return round(n / duration, 3) if duration > 0 else 0.0

    steady, steady_s = steady_rate(load)

    return RunSummary(
        num_requests=len(load.results), failed_requests=len(load.results) - len(ok), duration_s=round(duration, 3),
        req_s=rate(len(ok)), output_tok_s=rate(output), total_tok_s=rate(output + prompt),
        mean_input_tokens=round(prompt / len(ok), 1) if ok else 0.0,
        ttft_ms=latency_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=latency_ms([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=latency_ms([g for r in ok for g in r.gaps_s]),
        e2e_ms=latency_ms([r.e2e_s for r in ok]), steady_tok_s=steady, steady_s=steady_s,
        client_cores=round(load.client_cpu_s / duration, 2) if load.client_cpu_s is not None and duration > 0 else None)
