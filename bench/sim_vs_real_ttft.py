"""Where time to first token goes, on both sides of `bench.sim_vs_real`.

vLLM times each request's way to its first token (`vllm/v1/metrics/stats.py`): `vllm:request_queue_time_seconds`
from the engine core queueing it to first scheduling it, `vllm:request_prefill_time_seconds` from then to its
first token, and `vllm:time_to_first_token_seconds` from the API server's arrival time to the first token's
output. `sim serve` exports the same three. Their sums and counts over a run give each part's mean; with the
client's own TTFT (through the gateway), a run's mean TTFT splits into:

- outside the replica: the client's TTFT less the API server's (HTTP, the gateway, the SSE stream back);
- before the engine's queue: its TTFT less queue and prefill: the API server (tokenizing, handing over) and the
  engine's step in progress (vLLM's engine core takes new requests in between steps and its scheduler stamps them
  queued then; `sim serve` stamps them alike since 2026-11-29, before which its queue counted that wait);
- waiting in the engine's queue (for the token budget, a batch slot, blocks);
- prefill, to the first token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import markdown_table
from .sim_vs_real_ranking import point_of
from .sim_vs_real_steps import real_twins, twin_key

HISTOGRAMS = {"engine_ttft_s": "vllm:time_to_first_token_seconds", "queue_s": "vllm:request_queue_time_seconds",
              "prefill_s": "vllm:request_prefill_time_seconds"}
COUNTERS = tuple(f"{name}_{part}" for name in HISTOGRAMS.values() for part in ("sum", "count"))


def ttft_parts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each histogram's mean over the run (NaN where it counted nothing: a replica without the metric)."""
    parts = {}
    for key, name in HISTOGRAMS.items():
        count = after[f"{name}_count"] - before[f"{name}_count"]
        parts[key] = (after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count > 0 else math.nan
    return parts


def split(row: dict[str, Any]) -> tuple[float, float, float, float, float] | None:
    """A run's mean TTFT and its four parts in ms (outside the replica, before the engine's queue, queue,
    prefill), or None for a run without the histograms."""
    parts = (row.get("engine") or {}).get("ttft_parts")
    if not parts or not row["ttft_s"] or not all(math.isfinite(parts[k]) for k in HISTOGRAMS):
        return None
    client = float(np.mean(row["ttft_s"]))
    engine, queue, prefill = parts["engine_ttft_s"], parts["queue_s"], parts["prefill_s"]
    return tuple(1e3 * v for v in (client, client - engine, engine - queue - prefill, queue, prefill))  # type: ignore[return-value]


def ttft_lines(rows: Sequence[dict[str, Any]], sides: Sequence[str]) -> list[str]:
    """The report's section: per point and side, medians over runs of the mean TTFT and its parts."""
    cells: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    for r in rows:
        figures = split(r) if r["side"] in sides and r["workload"] != "chat" else None
        if figures:
            cells.setdefault((point_of(r), r["side"]), []).append(figures)
    if not cells:
        return []
    body = []
    for point, side in sorted(cells, key=lambda k: (k[0], list(sides).index(k[1]))):
        runs = cells[(point, side)]
        medians = [float(np.median(v)) for v in zip(*runs)]
        body.append([point, side, len(runs), *(f"{m:.1f}" for m in medians)])
    return ["## Where time to first token goes", "",
            "Mean TTFT per run in ms, split by vLLM's own request timings (`vllm:time_to_first_token_seconds`, "
            "`request_queue_time_seconds`, `request_prefill_time_seconds`; `sim serve` exports the same); medians "
            "over the runs of a point. Outside the replica: the client's TTFT less the API server's (the gateway, "
            "HTTP, the stream back). Before the queue: its TTFT less queue and prefill: the API server (tokenizing, "
            "handing over) and the engine's step in progress, since vLLM's engine core takes new requests in "
            "between steps. Queue: waiting for the token budget, a batch slot or blocks.", "",
            markdown_table(["point", "side", "runs", "TTFT", "outside the replica", "before the queue", "queue",
                            "prefill"], body), ""]


def twin_lines(rows: Sequence[dict[str, Any]], sides: Sequence[str]) -> list[str]:
    """The report's section: each simulated single-turn run beside its real twin (same workload, arrivals, load,
    seed and policy), part by part: the median over the pairs of simulated less real mean TTFT and of each part,
    and of the prefill's ratio. Where a side's TTFT is short, this says in which part."""
    real = {key: figures for key, r in real_twins(rows).items() if (figures := split(r))}
    body = []
    for side in sides:
        gaps = []
        for r in rows:
            twin = real.get(twin_key(r)) if r["side"] == side else None
            figures = split(r) if twin is not None and twin[4] > 0 else None
            if twin is not None and figures is not None:
                gaps.append((np.subtract(figures, twin), figures[4] / twin[4]))
        if gaps:
            diffs = np.median([d for d, _ in gaps], axis=0)
            body.append([side, len(gaps), *(f"{d:+.1f}" for d in diffs),
                         f"{float(np.median([ratio for _, ratio in gaps])):.2f}"])
    if not body:
        return []
    return ["## Each simulated run beside its real twin, part by part", "",
            "Medians over the pairs of runs (the same workload, arrivals, load, seed and policy) of the simulated "
            "run's mean TTFT and parts less the real one's, in ms (the parts as above), and of its mean prefill over "
            "the real one's.", "",
            markdown_table(["side", "pairs", "TTFT", "outside the replica", "before the queue", "queue", "prefill",
                            "prefill sim / real"], body), ""]


def streams_met(row: dict[str, Any]) -> float | None:
    """The mean over a run's requests of the other requests decoding on the same replica when its first token came
    (from the run's own send times, TTFTs and E2Es): the streams that replica's API server was sending then."""
    firsts, e2e = row.get("firsts"), row.get("e2e_s")
    if not firsts or not e2e or len(firsts) != len(e2e):
        return None
    spans = [(sent + ttft, sent + total, replica) for (sent, ttft, _, replica), total in zip(firsts, e2e)]
    by_replica: dict[str, list[tuple[float, float]]] = {}
    for first, end, replica in spans:
        by_replica.setdefault(replica, []).append((first, end))
    return float(np.mean([sum(f <= first < e for f, e in by_replica[replica]) - 1 for first, end, replica in spans]))


def outside_lines(rows: Sequence[dict[str, Any]], sides: Sequence[str]) -> list[str]:
    """The report's section: per side, each single-turn run's mean time outside the replica against the streams its
    first tokens met (`streams_met`), as a least-squares line over the runs."""
    body = []
    for side in sides:
        points = [(n, figures[1]) for r in rows if r["side"] == side and r["workload"] != "chat"
                  and (figures := split(r)) is not None and (n := streams_met(r)) is not None]
        if len(points) < 3:
            continue
        x, y = np.array(points).T
        (a, c), *_ = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y, rcond=None)
        residual = y - (a + c * x)
        body.append([side, len(points), f"{x.min():.1f}-{x.max():.1f}", f"{y.min():.1f}-{y.max():.1f}", f"{a:.1f}",
                     f"{c:.2f}", f"{residual.std():.1f}"])
    if not body:
        return []
    return ["## Outside the replica, against the streams a first token met", "",
            "Per run: the mean time outside the replica (as above, ms) against the mean number of other requests "
            "decoding on a first token's replica when it came (from the run's own requests); a least-squares line "
            "over the runs of each side. vLLM's API server writes every stream's chunks from one event loop.", "",
            markdown_table(["side", "runs", "streams", "outside ms", "line: ms", "+ ms a stream", "residual sd ms"],
                           body), ""]
