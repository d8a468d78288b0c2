"""The report of a run, computed from its per-request records: pure functions, no I/O.

Summary keys follow `vllm bench serve` (duration, completed, request_throughput, output_throughput,
mean/median/std/p99 of ttft, tpot, itl and e2el in ms, ...), plus the open-loop facts it lacks:
offered and achieved rate, schedule lag, requests in flight, requests per replica, and burst recovery.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest.records import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)
RECOVERY_TOLERANCE = 0.1  # recovered: windowed p99 back within 10% of the pre-burst p99


@dataclass(frozen=True)
class RunInfo:
    """What the report needs besides the records."""

    mode: str  # "open" or "closed"
    duration_s: float  # the schedule's (open) or the sending window's (closed) length
    scheduled: int | None = None  # requests in the open-loop schedule
    bursts_s: tuple[float, ...] = ()
    burst_period_s: float = 0.0
    conversations: int | None = None  # multi-turn, open loop: conversations the schedule started


def metric_values(records: Sequence[RequestRecord], metric: str) -> np.ndarray:
    """A metric's values in seconds over the completed requests (itl: every gap of every request)."""
    done = [r for r in records if r.ok]
    if metric == "ttft":
        return np.array([r.ttft_s for r in done if r.ttft_s is not None])
    if metric == "tpot":
        return np.array([t for r in done if (t := r.tpot_s) is not None])
    if metric == "itl":
        return np.array([g for r in done for g in r.itl_s])
    if metric == "e2el":
        return np.array([r.e2e_s for r in done])
    raise ValueError(f"metric {metric!r} is not one of {', '.join(METRICS)}")


def _stats_ms(name: str, seconds: np.ndarray) -> dict[str, float | None]:
    empty = seconds.size == 0
    ms = seconds * 1000.0
    stats: dict[str, float | None] = {
        f"mean_{name}_ms": None if empty else float(np.mean(ms)),
        f"median_{name}_ms": None if empty else float(np.median(ms)),
        f"std_{name}_ms": None if empty else float(np.std(ms)),
    }
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    return stats


def max_in_flight(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once (ends before starts at the same instant)."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def summarize(records: Sequence[RequestRecord], info: RunInfo) -> dict[str, Any]:
    """The run's summary as a JSON-ready dict."""
    done = [r for r in records if r.ok]
    duration = max((r.end_s for r in records), default=0.0)
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.requested_prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "mode": info.mode,
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "not_sent": (info.scheduled - len(records)) if info.scheduled is not None else 0,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
    }
    for metric in METRICS:
        summary.update(_stats_ms(metric, metric_values(records, metric)))
    summary.update(_rates(records, info))
    summary["max_in_flight"] = max_in_flight(records)
    summary["requests_per_replica"] = dict(sorted(Counter(r.replica or r.target for r in records).items()))
    summary["failure_reasons"] = dict(Counter(r.error for r in records if r.error).most_common())
    if info.bursts_s:
        summary["burst_recovery"] = burst_recovery(records, info.bursts_s, info.burst_period_s)
    if any(r.conversation is not None for r in records):
        summary.update(conversation_stats(records, info.conversations))
    return summary


def conversation_stats(records: Sequence[RequestRecord], scheduled: int | None) -> dict[str, Any]:
    """Multi-turn facts: conversations and turns, and how often a turn went to the replica of the turn before."""
    chats: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.conversation is not None:
            chats.setdefault(r.conversation, []).append(r)
    follows = stays = 0
    for turns in chats.values():
        turns.sort(key=lambda r: r.turn or 0)
        for before, after in zip(turns, turns[1:]):
            if before.ok and after.ok and before.replica and after.replica:
                follows += 1
                stays += before.replica == after.replica
    return {"conversations": len(chats), "conversations_scheduled": scheduled,
            "mean_turns": len(records) / len(chats) if chats else None,
            "later_turns_on_same_replica": stays / follows if follows else None}


def _rates(records: Sequence[RequestRecord], info: RunInfo) -> dict[str, float | None]:
    """Offered and achieved send rates and schedule lag (open loop; None in closed loop)."""
    lags = np.array([lag for r in records if (lag := r.lag_s) is not None]) * 1000.0
    last_sent = max((r.sent_s for r in records), default=0.0)
    window = max(info.duration_s, last_sent) if np.isfinite(info.duration_s) else last_sent
    return {
        "offered_rate": info.scheduled / info.duration_s if info.scheduled is not None else None,
        "achieved_rate": len(records) / window if window > 0 else None,
        "schedule_lag_mean_ms": float(np.mean(lags)) if lags.size else None,
        "schedule_lag_p99_ms": float(np.percentile(lags, 99)) if lags.size else None,
        "schedule_lag_max_ms": float(np.max(lags)) if lags.size else None,
    }


def _latency(record: RequestRecord, metric: str) -> float | None:
    return record.ttft_s if metric == "ttft" else record.e2e_s


def recovery_time(times: np.ndarray, latencies: np.ndarray, baseline: float, span: float,
                  window: float, tolerance: float = RECOVERY_TOLERANCE) -> float | None:
    """The first offset s in [0, span - window] at which the p99 latency of the requests sent in
    [s, s + window) is back within `tolerance` of `baseline`; None if it never is."""
    step = window / 5
    for start in np.arange(0.0, max(span - window, 0.0) + step / 2, step):
        inside = latencies[(times >= start) & (times < start + window)]
        if inside.size >= 3 and np.percentile(inside, 99) <= baseline * (1 + tolerance):
            return float(start)
    return None


def burst_recovery(records: Sequence[RequestRecord], bursts: Sequence[float], period: float) -> list[dict[str, Any]]:
    """For each burst: how long until requests sent after it saw their pre-burst p99 TTFT and e2e latency
    again (None: not before the next burst), and how long the burst's own requests took to drain.

    The pre-burst level is the p99 over the base-rate requests sent in the half period before the burst;
    recovery is measured on windows of the base-rate requests sent after it (see `recovery_time`).
    """
    results = []
    for at in bursts:
        in_burst = [r.scheduled_s is not None and abs(r.scheduled_s - at) < 1e-9 for r in records]
        own = [r for r, inside in zip(records, in_burst) if inside]
        base = [r for r, inside in zip(records, in_burst) if r.ok and not inside]
        before = [r for r in base if at - period / 2 <= r.sent_s < at]
        after = [r for r in base if at <= r.sent_s < at + period]
        entry: dict[str, Any] = {
            "at_s": float(at),
            "requests": len(own),
            "drain_s": max((r.end_s for r in own), default=at) - at,
        }
        rate = len(before) / (period / 2)
        window = min(max(10 / rate if rate else period, period / 20), period / 4)
        for metric in ("ttft", "e2el"):
            pre = np.array([v for r in before if (v := _latency(r, metric)) is not None])
            times = np.array([r.sent_s - at for r in after if _latency(r, metric) is not None])
            lat = np.array([v for r in after if (v := _latency(r, metric)) is not None])
            baseline = float(np.percentile(pre, 99)) if pre.size >= 5 else None
            recovery = (recovery_time(times, lat, baseline, period, window)
                        if baseline is not None and lat.size else None)
            entry[metric] = {"baseline_p99_ms": None if baseline is None else baseline * 1000, "recovery_s": recovery}
        results.append(entry)
    return results


@dataclass(frozen=True)
class Timeline:
    """Per-bin counts over the run (bin i covers [edges[i], edges[i+1]))."""

    edges: np.ndarray
    scheduled: np.ndarray  # requests/s the schedule asked for
    sent: np.ndarray  # requests/s actually sent
    completed: np.ndarray  # requests/s completed
    output_tokens: np.ndarray  # tokens/s received
    in_flight_t: np.ndarray  # step function of requests in flight: times ...
    in_flight_n: np.ndarray  # ... and the level from each time on


def timeline(records: Sequence[RequestRecord], schedule: Sequence[float] | None = None,
             bin_s: float = 1.0) -> Timeline:
    """Rates per time bin and the in-flight step function (`schedule`: the open-loop send times)."""
    end = max([r.end_s for r in records] + list(schedule if schedule is not None else []), default=0.0)
    edges = np.arange(0.0, end + bin_s, bin_s) if end > 0 else np.array([0.0, bin_s])

    def count(values: Sequence[float]) -> np.ndarray:
        per_bin: np.ndarray = np.histogram(np.asarray(values, dtype=float), edges)[0] / bin_s
        return per_bin

    tokens = [t for r in records if r.ok for t in r.token_times_s]
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    times = np.array([0.0] + [t for t, _ in events])
    levels = np.cumsum([0] + [s for _, s in events])
    return Timeline(
        edges=edges,
        scheduled=count(schedule if schedule is not None else []),
        sent=count([r.sent_s for r in records]),
        completed=count([r.end_s for r in records if r.ok]),
        output_tokens=count(tokens),
        in_flight_t=times,
        in_flight_n=levels,
    )
