"""The default judged on real replicas over several `bench.sim_vs_real` runs: item 3 of issue 17.

Each run directory's real single-turn runs are pooled per point (workload, arrivals, load as a fraction of that
run's own measured capacity): every request of every seed of every run, one p99 TTFT per policy. Then each policy
is tried as the default by the issue's rule (`sim_vs_real_ranking.verdict_lines`): within 10% of the best policy at
every point and never worse than round robin; if none is, the smallest worst point is named. Last, seed by seed:
in how many runs the default's p99 was the lower against each other policy (a sign test, which one slow request
in one seed cannot swing as it swings a pooled p99). And how sure each pooled ratio is: the default's pooled p99
over each other policy's, with a 90% interval from resampling the seeds (a seed of one directory is one unit, and
a resample takes whole units, both policies' runs of that seed together, so the schedule they shared stays paired).
Then the typical seed: the geometric mean over those seeds of the default's p99 over the other policy's in the same
seed, with its interval from the same resampling. A pooled p99 follows the few seeds with the slowest requests; here
each seed is one term of a mean, so the figure says how far apart the policies are in a usual run.

    python -m bench.policy_verdict runs/svr-a runs/svr-b [--replica-model runs/svr-a/replica_together.json]

With `--replica-model` (a directory's together calibration), each directory's runs are then set run by run beside
their own step speed over that model (`bench.sim_vs_real_report.run_by_run_lines`): whether a run's tail follows
the minute it ran in.

The runs' offered rates differ a little (each from its own capacity measurement), so pooling is by load fraction,
as the run directories were measured; the table says how many seeds and requests each cell holds.

The same verdict is then given in engine steps: each request's TTFT over its own run's TPOT p50, pooled the same
way. On this shared VM the machine's speed moves by a third between runs minutes apart (docs/sim.md), and the
policies of one seed run one after another, so whichever runs in a slow minute gets a slow tail. In steps that
minute divides out. It is a second view, not the goal's metric: a policy that unbalances the replicas also raises
its own TPOT, and so looks a little better in steps than it is.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import markdown_table
from .sim_vs_real_report import DEFAULT, POLICIES, done_runs, run_by_run_lines, summarize
from .sim_vs_real_ranking import p99_by_seed, point_of, verdict_lines


def read_rows(d: Path) -> list[dict[str, Any]]:
    """Every run of one directory (its runs.jsonl), or of a file in its place: a run's rows as kept (runs.jsonl,
    or gzipped: docs/bench/runs_*.jsonl.gz)."""
    path = d if d.is_file() else d / "runs.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{d}: no runs.jsonl (not a bench.sim_vs_real run directory?)")
    return list(done_runs(path).values())


def read(dirs: Sequence[Path]) -> list[list[dict[str, Any]]]:
    """Each directory's real single-turn runs, read once (`read_rows`); a file's seeds are units of their own as a
    directory's are."""
    return [[r for r in read_rows(d) if r["side"] == "real" and r["workload"] != "chat" and r["ttft_s"]]
            for d in dirs]


def pooled(runs: Sequence[Sequence[dict[str, Any]]]) -> dict[str, dict[str, tuple[float, int, int]]]:
    """point -> policy -> (p99 TTFT in ms, seeds, requests) over every directory's runs (`read`)."""
    table = summarize([r for rows in runs for r in rows]).get("real", {})
    return {pt: {p: (v["ttft_p99"], v["seeds"], v["n"]) for p, v in by.items()} for pt, by in table.items()}


def pooled_in_steps(runs: Sequence[Sequence[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """point -> policy -> p99 of TTFT / the run's own TPOT p50 over every request of every directory's runs: the
    pooled tail in engine steps, free of the machine's speed in the minute each run ran."""
    ratios: dict[str, dict[str, list[np.ndarray]]] = {}
    for rows in runs:
        for r in rows:
            if r["tpot_s"]:
                step = float(np.median(r["tpot_s"]))
                ratios.setdefault(point_of(r), {}).setdefault(r["policy"], []).append(np.asarray(r["ttft_s"]) / step)
    return {pt: {p: float(np.percentile(np.concatenate(v), 99)) for p, v in sorted(by.items())}
            for pt, by in sorted(ratios.items())}


def seed_by_seed(runs: Sequence[Sequence[dict[str, Any]]], default: str = DEFAULT
                 ) -> dict[str, dict[str, tuple[int, int]]]:
    """point -> policy -> (runs where the default's p99 TTFT was lower, runs where it was higher), over the seeds
    both ran in one directory: a sign test of the default against each other policy, free of the one slow request
    that sets a pooled p99."""
    out: dict[str, dict[str, list[int]]] = {}
    for rows in runs:
        for point, by_policy in p99_by_seed(rows, "real").items():
            for seed, mine in by_policy.get(default, {}).items():
                for p, by_seed in by_policy.items():
                    if p != default and seed in by_seed and by_seed[seed] != mine:
                        out.setdefault(point, {}).setdefault(p, [0, 0])[0 if mine < by_seed[seed] else 1] += 1
    return {pt: {p: (c[0], c[1]) for p, c in by.items()} for pt, by in sorted(out.items())}


def seed_units(runs: Sequence[Sequence[dict[str, Any]]]) -> dict[str, dict[tuple[int, int], dict[str, np.ndarray]]]:
    """point -> (directory, seed) -> policy -> that run's TTFTs (s): the units `paired_ratios` resamples."""
    out: dict[str, dict[tuple[int, int], dict[str, np.ndarray]]] = {}
    for i, rows in enumerate(runs):
        for r in rows:
            out.setdefault(point_of(r), {}).setdefault((i, r["seed"]), {})[r["policy"]] = np.asarray(r["ttft_s"])
    return out


@dataclass(frozen=True)
class Ratio:
    """The default's pooled p99 TTFT over another policy's, and the 5th and 95th percentiles of the same over
    resamples of their shared seeds."""

    ratio: float
    low: float
    high: float
    seeds: int


def _shared_seeds(runs: Sequence[Sequence[dict[str, Any]]], default: str
                  ) -> Iterator[tuple[str, str, list[tuple[np.ndarray, np.ndarray]]]]:
    """(point, other policy, [(the default's TTFTs, the other's) for each seed both ran]) where they share 2 or
    more seeds: the pairs `paired_ratios` and `seed_means` resample."""
    for point, units in sorted(seed_units(runs).items()):
        for other in sorted({p for by in units.values() for p in by} - {default}):
            shared = [(by[default], by[other]) for by in units.values() if default in by and other in by]
            if len(shared) >= 2:
                yield point, other, shared


def paired_ratios(runs: Sequence[Sequence[dict[str, Any]]], default: str = DEFAULT, resamples: int = 1000,
                  seed: int = 0) -> dict[str, dict[str, Ratio]]:
    """point -> other policy -> the default's pooled p99 over its pooled p99 on the seeds both ran, with a 90%
    interval from resampling those seeds with replacement (both policies' runs of a drawn seed together)."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, Ratio]] = {}
    for point, other, shared in _shared_seeds(runs, default):

        def ratio(picks: Sequence[int]) -> float:
            mine = np.concatenate([shared[k][0] for k in picks])
            theirs = np.concatenate([shared[k][1] for k in picks])
            return float(np.percentile(mine, 99) / np.percentile(theirs, 99))
        draws = [ratio(rng.integers(0, len(shared), len(shared))) for _ in range(resamples)]
        low, high = np.percentile(draws, [5, 95])
        out.setdefault(point, {})[other] = Ratio(ratio(range(len(shared))), float(low), float(high), len(shared))
    return out


def seed_means(runs: Sequence[Sequence[dict[str, Any]]], default: str = DEFAULT, resamples: int = 1000,
               seed: int = 0) -> dict[str, dict[str, Ratio]]:
    """point -> other policy -> the geometric mean, over the seeds both ran, of the default's p99 TTFT over the
    other's in that seed, with a 90% interval from resampling those seeds with replacement."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, Ratio]] = {}
    for point, other, shared in _shared_seeds(runs, default):
        logs = np.log([np.percentile(mine, 99) / np.percentile(theirs, 99) for mine, theirs in shared])
        draws = [logs[rng.integers(0, len(logs), len(logs))].mean() for _ in range(resamples)]
        low, high = np.exp(np.percentile(draws, [5, 95]))
        out.setdefault(point, {})[other] = Ratio(float(np.exp(logs.mean())), float(low), float(high), len(logs))
    return out


def _ratio_table(ratios: dict[str, dict[str, Ratio]], default: str) -> str:
    others = sorted({p for by in ratios.values() for p in by})
    body = [[pt, *(f"{by[p].ratio:.2f} ({by[p].low:.2f}-{by[p].high:.2f}; {by[p].seeds})" if p in by else ""
                   for p in others)] for pt, by in ratios.items()]
    return markdown_table(["point", *(f"{default} / {p}" for p in others)], body)


def interval_lines(ratios: dict[str, dict[str, Ratio]], default: str = DEFAULT, blind: str = "round_robin",
                   within: float = 0.10) -> list[str]:
    """The table of `paired_ratios`, and which of item 3's two conditions (`verdict_lines`' marks) the seeds show
    broken (the interval wholly past the mark: 1 + `within` x another policy, 1.00 x `blind`) and which they cannot
    tell."""
    others = sorted({p for by in ratios.values() for p in by})
    marks = {p: 1.0 if p == blind else 1 + within for p in others}
    broken = [f"{pt} against {p} ({r.low:.2f}-{r.high:.2f} x)" for pt, by in ratios.items() for p, r in by.items()
              if r.low > marks[p]]
    unsure = [f"{pt} against {p} ({r.ratio:.2f} x, {r.low:.2f}-{r.high:.2f})" for pt, by in ratios.items()
              for p, r in by.items() if r.ratio > marks[p] >= r.low]
    lines = [f"The default's pooled p99 TTFT over each other policy's, on the seeds both ran, with a 90% interval "
             "from resampling those seeds (seeds):", "",
             _ratio_table(ratios, default), ""]
    lines.append(f"The seeds show the default past item 3's marks (within {1 + within:.2f} x each policy, at most "
                 f"1.00 x {blind.replace('_', ' ')}) at: " + ("; ".join(broken) if broken else "no point") + ".")
    if unsure:
        lines.append("Past a mark pooled, but inside the seeds' noise: " + "; ".join(unsure) + ".")
    return [*lines, ""]


def seed_mean_lines(means: dict[str, dict[str, Ratio]], default: str = DEFAULT) -> list[str]:
    """The table of `seed_means`."""
    if not means:
        return []
    return ["The typical seed: the geometric mean over the seeds both ran of the default's p99 TTFT over each "
            "other policy's in the same seed, with a 90% interval from resampling those seeds (seeds). Each seed "
            "is one term here, where a pooled p99 follows the seeds with the slowest requests:", "",
            _ratio_table(means, default), ""]


def verdict(dirs: Sequence[Path], replica_model: Path | None = None) -> str:
    """The report (see the module's docstring); `replica_model`: set each directory's runs beside their speed."""
    runs = read(dirs)
    table = pooled(runs)
    if not table:
        raise ValueError("no real single-turn runs in " + ", ".join(map(str, dirs)))
    present = {p for by in table.values() for p in by}
    policies = [p for p in POLICIES if p in present] + sorted(present - set(POLICIES))  # e.g. estimated_ttft
    body = [[pt, *(f"{by[p][0]:.0f} ({by[p][1]}, {by[p][2]})" if p in by else "" for p in policies)]
            for pt, by in table.items()]
    lines = [f"Real vLLM-CPU, p99 TTFT in ms pooled over {len(dirs)} run director{'y' if len(dirs) == 1 else 'ies'} "
             "(seeds, requests):", "", markdown_table(["point", *policies], body), ""]
    lines += verdict_lines({pt: {p: v[0] for p, v in by.items()} for pt, by in table.items()}, DEFAULT)
    steps = pooled_in_steps(runs)
    body = [[pt, *(f"{by[p]:.1f}" if p in by else "" for p in policies)] for pt, by in steps.items()]
    lines += ["In engine steps (each TTFT over its run's own TPOT p50; the machine's speed in each run's minute "
              "divides out; a second view, not the goal's metric), pooled p99:", "",
              markdown_table(["point", *policies], body), ""]
    lines += verdict_lines(steps, DEFAULT)
    signs = seed_by_seed(runs)
    others = [p for p in policies if p != DEFAULT and any(p in by for by in signs.values())]
    if others:
        total = {p: [sum(by[p][k] for by in signs.values() if p in by) for k in (0, 1)] for p in others}
        body = [[pt, *(f"{by[p][0]} of {sum(by[p])}" if p in by else "" for p in others)] for pt, by in signs.items()]
        body.append(["all", *(f"**{lo} of {lo + hi}**" for lo, hi in total.values())])
        lines += ["Seed by seed (one point and seed of one run directory), the runs where the default's p99 TTFT "
                  "was lower than each other policy's (a coin: half):", "",
                  markdown_table(["point", *(f"default lower than {p}" for p in others)], body), ""]
    lines += interval_lines(paired_ratios(runs))
    lines += seed_mean_lines(seed_means(runs))
    if replica_model is not None:
        if not replica_model.is_file():
            raise FileNotFoundError(f"--replica-model {replica_model}: no such file")
        for d, rows in zip(dirs, runs):
            meta = d / "meta.json"
            replicas = int(json.loads(meta.read_text()).get("replicas", 2)) if meta.is_file() else 2
            lines += [f"### {d}, run by run ({replicas} replicas; speeds over {replica_model})", "",
                      *(run_by_run_lines(rows, replicas, str(replica_model))
                        or ["No run with vLLM's step counters.", ""])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="bench.sim_vs_real output directories (--out), or the "
                        "runs.jsonl of one, gzipped or not (docs/bench/runs_*.jsonl.gz)")
    parser.add_argument("--replica-model", type=Path, help="a together calibration (replica_together.json): set "
                        "each directory's runs beside their own step speed over it")
    args = parser.parse_args(argv)
    try:
        print(verdict(args.dirs, args.replica_model))
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
