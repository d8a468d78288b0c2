"""Time to first token by prompt length, on both sides of `bench.sim_vs_real`: a model can get a point's median
right while missing each length the opposite way (docs/sim.md, "Core work": the core-work model's 1,024-token
prompts 10% short and its 128-token ones right, the plain model the reverse).

Each run keeps its requests' first tokens (`firsts`: sent, TTFT, prompt tokens, replica). Per single-turn point
(workload, arrival, load), pooled over seeds and policies where both sides ran, the TTFTs are grouped by prompt
length: each length where the workload has at most four (the `mix`: 128 and 1,024), else the halves about the real
side's median length.

Then, where a workload has a few lengths (the `mix`), its shorter prompts split by what came just before them: a
prompt of the longest length sent within AFTER_LONG_S before it to the same replica, to another one only, or none
(each side's own routing). A 128-token prompt behind a 1,024-token prefill on its replica waits for it; one after
a long prompt elsewhere shares only the machine; a model can miss either, or neither and still be short.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import markdown_table
from .sim_vs_real_ranking import point_of
from .sim_vs_real_steps import real_twins, twin_key

MAX_LENGTHS = 4  # distinct prompt lengths a workload may have to be grouped length by length
AFTER_LONG_S = 0.1  # a shorter prompt sent this soon after one of the longest length is "after a long prompt"
AFTER = ("none", "on another replica", "on its replica")  # what `after_long` tells apart, in the table's order


def groups(lengths: Sequence[int]) -> tuple[list[str], Any]:
    """The group names for these prompt lengths and a function from a length to its group."""
    distinct = sorted(set(lengths))
    if len(distinct) <= MAX_LENGTHS:
        return [str(n) for n in distinct], str
    median = float(np.median(lengths))
    names = [f"<= {median:.0f}", f"> {median:.0f}"]
    return names, lambda n: names[0] if n <= median else names[1]


def twin_pairs(rows: Sequence[dict[str, Any]], side: str) -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Per point, each run of `side` with its real twin, where both kept their first tokens."""
    real = {key: r for key, r in real_twins(rows).items() if r.get("firsts")}
    pairs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r in rows:
        twin = real.get(twin_key(r)) if r["side"] == side and r.get("firsts") else None
        if twin is not None:
            pairs.setdefault(point_of(r), []).append((twin, r))
    return pairs


def percentile_cells(want: Sequence[float], got: Sequence[float]) -> list[str]:
    """Real and simulated p50 and p90 and the errors, as table cells."""
    cells = []
    for q in (50, 90):
        a, b = float(np.percentile(want, q)), float(np.percentile(got, q))
        cells += [f"{a:.0f}", f"{b:.0f}", f"{b / a - 1:+.0%}"]
    return cells


def length_lines(rows: Sequence[dict[str, Any]], sides: Sequence[str]) -> list[str]:
    """The report's section: per point, prompt length and simulated side, the real and simulated TTFT p50 and p90
    (ms) and their errors."""
    body = []
    for side in sides:
        pairs = twin_pairs(rows, side)
        for point in sorted(pairs):
            names, group_of = groups([f[2] for twin, _ in pairs[point] for f in twin["firsts"]])
            ttfts: dict[tuple[str, str], list[float]] = {}
            for twin, simulated in pairs[point]:
                for name, row in (("real", twin), ("sim", simulated)):
                    for f in row["firsts"]:
                        ttfts.setdefault((name, group_of(f[2])), []).append(f[1] * 1e3)
            for group in names:
                got, want = ttfts.get(("sim", group), []), ttfts.get(("real", group), [])
                if not got or not want:
                    continue
                body.append([point, group, side, len(want), *percentile_cells(want, got)])
    if not body:
        return []
    return ["## Time to first token by prompt length", "",
            "Per single-turn point, pooled over its seeds and policies where both sides ran: each prompt length's "
            "TTFTs (ms; a workload with more than four lengths in the halves about the real median), the real side "
            "against each simulated one. A point's median can hold while its lengths miss the opposite ways.", "",
            markdown_table(["point", "prompt tokens", "side", "real requests", "real p50", "sim p50", "err",
                            "real p90", "sim p90", "err"], body), ""]


def after_long(firsts: Sequence[Sequence[Any]], longest: int) -> list[str]:
    """For each first token (sent, TTFT, prompt tokens, replica), where a prompt of `longest` tokens went that was
    sent within AFTER_LONG_S before it (`AFTER`: on its replica, else on another one, else none)."""
    longs = [(f[0], f[3]) for f in firsts if f[2] == longest]

    def where(f: Sequence[Any]) -> str:
        near = [replica for t, replica in longs if 0 < f[0] - t <= AFTER_LONG_S]
        return AFTER[2] if f[3] in near else AFTER[1] if near else AFTER[0]

    return [where(f) for f in firsts]


def after_long_lines(rows: Sequence[dict[str, Any]], sides: Sequence[str]) -> list[str]:
    """The report's section: per point with a few prompt lengths, each shorter length's TTFT p50 and p90 on both
    sides, after a prompt of the longest length and not."""
    body = []
    for side in sides:
        pairs = twin_pairs(rows, side)
        for point in sorted(pairs):
            distinct = sorted({f[2] for twin, _ in pairs[point] for f in twin["firsts"]})
            if not 1 < len(distinct) <= MAX_LENGTHS:
                continue
            ttfts: dict[tuple[str, int, str], list[float]] = {}
            for twin, simulated in pairs[point]:
                for name, row in (("real", twin), ("sim", simulated)):
                    for f, after in zip(row["firsts"], after_long(row["firsts"], distinct[-1])):
                        ttfts.setdefault((name, f[2], after), []).append(f[1] * 1e3)
            for length in distinct[:-1]:
                for after in AFTER:
                    got, want = ttfts.get(("sim", length, after), []), ttfts.get(("real", length, after), [])
                    if got and want:
                        body.append([point, length, after, side, len(want), *percentile_cells(want, got)])
    if not body:
        return []
    return ["## Time to first token after a long prompt", "",
            f"The shorter prompts of a point with a few lengths, pooled as above, split by where a prompt of the "
            f"longest length sent in the {AFTER_LONG_S * 1e3:.0f} ms before went: on the prompt's own replica (it "
            "waits behind that prefill), on another one only (they share the machine), or none (each side's own "
            "routing; the schedule is the same on both).", "",
            markdown_table(["point", "prompt tokens", "a long prompt just before", "side", "real requests", "real p50",
                            "sim p50", "err", "real p90", "sim p90", "err"], body), ""]
