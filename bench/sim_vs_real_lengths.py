"""Time to first token by prompt length, on both sides of `bench.sim_vs_real`: a model can get a point's median
right while missing each length the opposite way (docs/sim.md, "Core work": the core-work model's 1,024-token
prompts 10% short and its 128-token ones right, the plain model the reverse).

Each run keeps its requests' first tokens (`firsts`: sent, TTFT, prompt tokens, replica). Per single-turn point
(workload, arrival, load), pooled over seeds and policies where both sides ran, the TTFTs are grouped by prompt
length: each length where the workload has at most four (the `mix`: 128 and 1,024), else the halves about the real
side's median length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import markdown_table
from .sim_vs_real_ranking import point_of
from .sim_vs_real_steps import real_twins, twin_key

MAX_LENGTHS = 4  # distinct prompt lengths a workload may have to be grouped length by length


def groups(lengths: Sequence[int]) -> tuple[list[str], Any]:
    """The group names for these prompt lengths and a function from a length to its group."""
    distinct = sorted(set(lengths))
    if len(distinct) <= MAX_LENGTHS:
        return [str(n) for n in distinct], str
    median = float(np.median(lengths))
    names = [f"<= {median:.0f}", f"> {median:.0f}"]
    return names, lambda n: names[0] if n <= median else names[1]


def length_lines(rows: Sequence[dict[str, Any]], sides: Sequence[str]) -> list[str]:
    """The report's section: per point, prompt length and simulated side, the real and simulated TTFT p50 and p90
    (ms) and their errors."""
    real = {key: r for key, r in real_twins(rows).items() if r.get("firsts")}
    body = []
    for side in sides:
        pairs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        for r in rows:
            twin = real.get(twin_key(r)) if r["side"] == side and r.get("firsts") else None
            if twin is not None:
                pairs.setdefault(point_of(r), []).append((twin, r))
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
                cells = []
                for q in (50, 90):
                    a, b = float(np.percentile(want, q)), float(np.percentile(got, q))
                    cells += [f"{a:.0f}", f"{b:.0f}", f"{b / a - 1:+.0%}"]
                body.append([point, group, side, len(want), *cells])
    if not body:
        return []
    return ["## Time to first token by prompt length", "",
            "Per single-turn point, pooled over its seeds and policies where both sides ran: each prompt length's "
            "TTFTs (ms; a workload with more than four lengths in the halves about the real median), the real side "
            "against each simulated one. A point's median can hold while its lengths miss the opposite ways.", "",
            markdown_table(["point", "prompt tokens", "side", "real requests", "real p50", "sim p50", "err",
                            "real p90", "sim p90", "err"], body), ""]
