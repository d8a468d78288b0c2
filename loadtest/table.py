"""Text tables of summaries: one run (`vllm bench serve` style) or several side by side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_LABEL = 60
ROWS: tuple[tuple[str, str, str], ...] = (
    # (label, summary key, format)
    ("Completed requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Not sent", "not_sent", "{:d}"),
    ("Duration (s)", "duration", "{:.2f}"),
    ("Offered rate (req/s)", "offered_rate", "{:.2f}"),
    ("Achieved send rate (req/s)", "achieved_rate", "{:.2f}"),
    ("Schedule lag mean (ms)", "schedule_lag_mean_ms", "{:.2f}"),
    ("Schedule lag p99 (ms)", "schedule_lag_p99_ms", "{:.2f}"),
    ("Schedule lag max (ms)", "schedule_lag_max_ms", "{:.2f}"),
    ("Max requests in flight", "max_in_flight", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.1f}"),
    ("Mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"),
    ("Median TTFT (ms)", "median_ttft_ms", "{:.1f}"),
    ("P99 TTFT (ms)", "p99_ttft_ms", "{:.1f}"),
    ("Mean TPOT (ms)", "mean_tpot_ms", "{:.2f}"),
    ("Median TPOT (ms)", "median_tpot_ms", "{:.2f}"),
    ("P99 TPOT (ms)", "p99_tpot_ms", "{:.2f}"),
    ("Mean ITL (ms)", "mean_itl_ms", "{:.2f}"),
    ("Median ITL (ms)", "median_itl_ms", "{:.2f}"),
    ("P99 ITL (ms)", "p99_itl_ms", "{:.2f}"),
    ("Mean E2E latency (ms)", "mean_e2el_ms", "{:.1f}"),
    ("Median E2E latency (ms)", "median_e2el_ms", "{:.1f}"),
    ("P99 E2E latency (ms)", "p99_e2el_ms", "{:.1f}"),
)
CHAT_ROWS: tuple[tuple[str, str, str], ...] = (
    ("Conversations", "conversations", "{:d}"),
    ("Mean turns per conversation", "mean_turns", "{:.2f}"),
    ("Later turns on the same replica", "later_turns_on_same_replica", "{:.1%}"),
)


def _cell(summary: dict[str, Any], key: str, fmt: str) -> str:
    value = summary.get(key)
    return "-" if value is None else fmt.format(value)


def _recovery_cell(summary: dict[str, Any], metric: str) -> str | None:
    """'max 2.1 s' over the bursts that had a pre-burst level, with how many never recovered."""
    bursts = summary.get("burst_recovery")
    if not bursts:
        return None
    measured = [b[metric]["recovery_s"] for b in bursts if b[metric]["baseline_p99_ms"] is not None]
    if not measured:
        return "-"  # no base-rate requests before the bursts to compare with
    known = [t for t in measured if t is not None]
    text = f"max {max(known):.1f} s" if known else "never"
    missed = len(measured) - len(known)
    return text + (f" ({missed}/{len(measured)} not)" if missed and known else "")


def _drain_cell(summary: dict[str, Any]) -> str | None:
    bursts = summary.get("burst_recovery")
    return f"max {max(b['drain_s'] for b in bursts):.1f} s" if bursts else None


def _extra_rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    rows = []
    replicas = sorted({name for s in summaries for name in s.get("requests_per_replica", {})})
    for name in replicas:
        rows.append((f"Requests to {name}", [str(s.get("requests_per_replica", {}).get(name, 0)) for s in summaries]))
    for label, cells in (("Burst recovery, p99 TTFT", [_recovery_cell(s, "ttft") for s in summaries]),
                         ("Burst recovery, p99 E2E", [_recovery_cell(s, "e2el") for s in summaries]),
                         ("Burst drain", [_drain_cell(s) for s in summaries])):
        if any(c is not None for c in cells):
            rows.append((label, [c or "-" for c in cells]))
    return rows


def format_table(summaries: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> str:
    """A table with one column per summary (one summary: a plain two-column result)."""
    chats = CHAT_ROWS if any("conversations" in s for s in summaries) else ()
    rows = [(label, [_cell(s, key, fmt) for s in summaries]) for label, key, fmt in ROWS + chats]
    rows += _extra_rows(summaries)
    reasons = sorted({reason for s in summaries for reason in s.get("failure_reasons", {})})
    rows += [(f"Failed: {reason}"[:MAX_LABEL], [str(s.get("failure_reasons", {}).get(reason, 0)) for s in summaries])
             for reason in reasons]
    header = list(names) if names else []
    width = max(len(label) for label, _ in rows) + 2
    col = max([len(c) for _, cells in rows for c in cells] + [len(h) for h in header] + [8]) + 2
    lines = []
    title = " Load test result " if len(summaries) == 1 else " Load test comparison "
    total = width + col * len(summaries)
    lines.append(title.center(total, "="))
    if header:
        lines.append(" " * width + "".join(h.rjust(col) for h in header))
    for label, cells in rows:
        lines.append(label.ljust(width) + "".join(c.rjust(col) for c in cells))
    lines.append("=" * total)
    return "\n".join(lines)
