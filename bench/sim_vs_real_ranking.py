"""Whether the real side ranks the policies the same way twice, and where it does, whether the simulator agrees.

The issue's ranking goal compares one ordering of the policies (by pooled p99 TTFT) on each side. That ordering is
only worth matching where the real side itself repeats it. Here each seed of a point is a run of its own, so:

- **seed against seed**: how often two seeds of the real side give the same full ranking, and the share of policy
  pairs that two seeds order the same way (1.0: always; 0.5: a coin);
- **decided pairs**: the policy pairs that every seed of the real side orders the same way. With k seeds a pair
  that is a coin toss still looks decided with probability 2^(1-k) (a quarter with 3 seeds);
- **the simulator on them**: of the decided pairs, how many the simulator's pooled figures order the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import markdown_table


def point_of(row: dict[str, Any]) -> str:
    """A run's point, as every table of the comparison names it: workload/arrivals/load."""
    return f"{row['workload']}/{row['arrival']}/{row['load']:g}"


def p99_by_seed(rows: Sequence[dict[str, Any]], side: str) -> dict[str, dict[str, dict[int, float]]]:
    """point -> policy -> seed -> p99 TTFT (s) of that one run; single-turn points only."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for r in rows:
        if r["side"] == side and r["workload"] != "chat" and r["ttft_s"]:
            out.setdefault(point_of(r), {}).setdefault(r["policy"], {})[r["seed"]] = float(np.percentile(r["ttft_s"], 99))
    return out


def _order(a: float, b: float) -> int:
    return int(np.sign(a - b))


def ranking_table(rows: Sequence[dict[str, Any]], pooled: dict[str, dict[str, Any]], sim_side: str
                  ) -> tuple[list[list[object]], int, int, int]:
    """Per point, the real side's own agreement and the simulator's (the rows of `ranking_lines`' table), and over
    them: the pairs the simulator orders as every real seed does, the pairs every real seed orders alike, and the
    fewest seeds of a point. `pooled`: each side's figures pooled over seeds (`sim_vs_real_report.summarize`)."""
    real = p99_by_seed(rows, "real")
    real_pooled = {pt: {p: v["ttft_p99"] for p, v in by.items()} for pt, by in pooled.get("real", {}).items()}
    sim_pooled = {pt: {p: v["ttft_p99"] for p, v in by.items()} for pt, by in pooled.get(sim_side, {}).items()}
    body: list[list[object]] = []
    decided_all = agreed_all = 0
    seeds_n = 0  # the fewest seeds of a point in the table
    for point, by_policy in real.items():
        if point not in sim_pooled:
            continue
        policies = sorted(p for p in by_policy if p in sim_pooled[point])
        seeds = sorted(set.intersection(*(set(by_policy[p]) for p in policies))) if policies else []
        if len(policies) < 2 or len(seeds) < 2:
            continue
        pairs = list(itertools.combinations(policies, 2))
        seed_pairs = list(itertools.combinations(seeds, 2))
        rank = {s: sorted(policies, key=lambda p: by_policy[p][s]) for s in seeds}
        same_rank = sum(rank[x] == rank[y] for x, y in seed_pairs)
        concordance = np.mean([np.mean([_order(by_policy[a][x], by_policy[b][x]) == _order(by_policy[a][y],
                                                                                         by_policy[b][y])
                                        for a, b in pairs]) for x, y in seed_pairs])
        decided = [(a, b) for a, b in pairs if len({_order(by_policy[a][s], by_policy[b][s]) for s in seeds}) == 1]
        sim = sim_pooled[point]
        agreed = sum(_order(sim[a], sim[b]) == _order(by_policy[a][seeds[0]], by_policy[b][seeds[0]])
                     for a, b in decided)
        pooled_same = np.mean([_order(sim[a], sim[b]) == _order(real_pooled[point][a], real_pooled[point][b])
                               for a, b in pairs])
        decided_all, agreed_all = decided_all + len(decided), agreed_all + agreed
        seeds_n = min(seeds_n, len(seeds)) if seeds_n else len(seeds)
        body.append([point, len(seeds), f"{same_rank} of {len(seed_pairs)}", f"{concordance:.2f}",
                     f"{len(decided)} of {len(pairs)}", f"{agreed} of {len(decided)}", f"{pooled_same:.2f}"])
    return body, agreed_all, decided_all, seeds_n


def ranking_lines(rows: Sequence[dict[str, Any]], pooled: dict[str, dict[str, Any]], sim_side: str) -> list[str]:
    """The report's section for one simulated side: `ranking_table` with what its columns mean."""
    body, agreed_all, decided_all, seeds_n = ranking_table(rows, pooled, sim_side)
    if not body:
        return []
    return [f"## Is the real ranking decided? (`{sim_side}`)", "",
            "Per point: how often two seeds of the real side rank the policies alike by p99 TTFT (whole ranking, "
            "and the share of policy pairs two seeds order the same way: 1.00 always, 0.50 a coin); the pairs every "
            "real seed orders the same way (\"decided\"), and how many of those the simulator's pooled figures "
            "order the same way; last, the share of all pairs the pooled figures of the two sides order alike.", "",
            markdown_table(["point", "seeds", "real: same ranking, seed pairs", "real: pairs alike, seed vs seed",
                            "decided pairs", "sim agrees on decided", "sim vs real pooled, pairs alike"], body), "",
            f"`{sim_side}` orders {agreed_all} of the {decided_all} decided pairs as the real side does. With "
            f"{seeds_n} seeds a pair that is a coin toss looks decided with probability {2 ** (1 - seeds_n):.2f}.",
            ""]


def verdict_lines(p99: dict[str, dict[str, float]], default: str, blind: str = "round_robin",
                  within: float = 0.10) -> list[str]:
    """Item 3's rule applied to pooled p99 TTFTs (`p99`: point -> policy -> p99), each policy in turn as the default:
    is it within `within` of the best policy at every point and never worse than `blind` (round robin)? If none is,
    the policy with the smallest worst point (its p99 over the point's best) is named: a summary, not a pick, since
    at a few seeds a point's worst is set by one slow request (docs/routing.md)."""
    points = [by for by in p99.values() if len(by) > 1]
    policies = sorted(set.intersection(*(set(by) for by in points))) if points else []
    if len(policies) < 2:
        return []
    body: list[list[object]] = []
    worst: dict[str, float] = {}
    meets: list[str] = []
    for p in policies:
        over_best = [by[p] / min(by[q] for q in policies) for by in points]
        over_blind = [by[p] / by[blind] for by in points] if blind != p and all(blind in by for by in points) else []
        worst[p] = max(over_best)
        ok = round(worst[p], 2) <= 1 + within and round(max(over_blind, default=1.0), 2) <= 1.0  # as shown
        meets += [p] if ok else []
        body.append([p + (" (default)" if p == default else ""), f"{worst[p]:.2f}",
                     f"{float(np.exp(np.mean(np.log(over_best)))):.2f}",
                     f"{max(over_blind):.2f}" if over_blind else "", "yes" if ok else "no"])
    smallest = min(policies, key=lambda p: worst[p])
    pick = (f"{', '.join(meets)} meet{'s' if len(meets) == 1 else ''} it" if meets else
            f"no policy meets it; the smallest worst point is {smallest}'s ({worst[smallest]:.2f} x the best)")
    return ["Each policy as the default, over these points: its worst p99 over the point's best, the geometric mean "
            f"of that ratio, its worst over {blind}, and whether it meets item 3's goal (within {within:.0%} of the "
            f"best at every point and never worse than {blind}).", "",
            markdown_table(["policy", "worst x best", "mean x best", f"worst x {blind}", "meets the goal"], body), "",
            f"Over {len(points)} point{'s' if len(points) > 1 else ''}: {pick}.", ""]
