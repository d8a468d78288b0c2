"""The report's first section: each simulated side held against the goals (medians within 15%, p99 TTFT within
25%, the policy pairs the real side decides ordered alike), and how fast the real engines ran against the
calibration under this load, which says whether the errors measure the simulator or the machine's drift.

On a shared VM the machine's speed moves by up to half within minutes (docs/sim.md): a calibration taken before the
runs then sets every simulated step too fast or too slow, and near saturation a few percent in the step grow
several-fold in TPOT. So next to each side's errors the section gives the real engines' mean step over the
calibrated model at their own batch (vLLM's counters, `sim_vs_real_steps.step_ratio`), over the real runs, and
says when it lies outside `DRIFT` of 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sim.measured import ReplicaModel

from .common import markdown_table
from .sim_vs_real_ranking import point_of, ranking_table
from .sim_vs_real_steps import step_ratio

GOALS = {"ttft_p50": 0.15, "ttft_p99": 0.25, "tpot_p50": 0.15, "e2e_p50": 0.15}  # median |sim / real - 1|
DRIFT = 0.10  # the real engines this far from the calibrated model at their own batch: the machine moved


def traffic_of(point: str) -> str:
    """A point's traffic, its name less the load: workload/arrivals (`mix/gamma/0.8` -> `mix/gamma`)."""
    return point.rsplit("/", 1)[0]


def median_errors(real: dict[str, Any], sim: dict[str, Any], traffic: str | None = None
                  ) -> tuple[dict[str, float], int]:
    """Median over the single-turn rows (point and policy) both sides have of |sim / real - 1|, per metric of
    `GOALS`, and the number of rows; only the points of `traffic` where given."""
    errors: dict[str, list[float]] = {m: [] for m in GOALS}
    for point, by in real.items():
        if point.startswith("chat") or point not in sim or traffic not in (None, traffic_of(point)):
            continue
        for policy in (p for p in by if p in sim[point]):
            for m in GOALS:
                errors[m].append(abs(sim[point][policy][m] / by[policy][m] - 1))
    rows = len(errors["ttft_p50"])
    return ({m: float(np.median(v)) for m, v in errors.items()} if rows else {}), rows


def speed_ratios(rows: Sequence[dict[str, Any]], replicas: int, model_path: str | None) -> list[float]:
    """Each single-turn real run's mean step over the calibrated model at that run's own batch (empty without the
    model's file or vLLM's counters)."""
    if not model_path or not Path(model_path).exists():
        return []
    model = ReplicaModel.load(model_path)
    ratios = (step_ratio(r, replicas, model) for r in rows if r["side"] == "real" and r["workload"] != "chat")
    return [x for x in ratios if x is not None and math.isfinite(x)]


def goals_lines(sides: Sequence[tuple[str, str, Sequence[dict[str, Any]], dict[str, dict[str, Any]]]],
                rows: Sequence[dict[str, Any]], replicas: int, model_path: str | None) -> list[str]:
    """`sides`: (name, what it is, the rows it is judged on, those rows pooled by `summarize`) per simulated side;
    `model_path`: the calibration the speed is read against."""
    body: list[list[object]] = []
    for name, what, judged, pooled in sides:
        if row := _goal_row(name, judged, pooled, None):
            body.append([f"`{name}` ({what})", *row])
    if not body:
        return []
    lines = ["## The goals", "",
             "Median over the single-turn rows (point and policy) of |sim / real - 1|; goals: " + ", ".join(
                 f"{m} {goal:.0%}" for m, goal in GOALS.items()) + " (* where missed). Decided pairs: the policy "
             "pairs every real seed orders alike by p99 TTFT, and how many of them the side's pooled figures order "
             "the same way.", "",
             markdown_table(["side", "rows", *GOALS, "decided pairs ordered alike", "error goals met"], body), ""]
    ratios = speed_ratios(rows, replicas, model_path)
    if ratios:
        mid = float(np.median(ratios))
        lines += [f"The machine's speed against the calibration: over the {len(ratios)} single-turn real runs the "
                  f"engines stepped {mid:.2f} x the calibrated model at their own batch (median; {min(ratios):.2f}-"
                  f"{max(ratios):.2f} x by run; vLLM's counters)."]
        if abs(mid - 1) > DRIFT or max(ratios) / min(ratios) > 1 + 2 * DRIFT:
            lines[-1] += (f" That is more than {DRIFT:.0%} from the calibration, or spread wider than "
                          f"{2 * DRIFT:.0%} over the runs: the machine did not hold the speed it was calibrated at, "
                          "and the errors above measure that as much as the simulator. `--pair-steps` runs each "
                          "simulated run at its real twin's speed (an oracle for the speed: its errors are the "
                          "simulator's own); `--match-steps` at the speed of the seed-0 runs, judged on the others.")
        lines.append("")
    return lines + _by_traffic(sides, rows, replicas, model_path)


def _goal_row(name: str, judged: Sequence[dict[str, Any]], pooled: dict[str, dict[str, Any]], traffic: str | None
              ) -> list[object]:
    """One side's row of the goals' table (rows, errors, decided pairs ordered alike, met), over `traffic`'s points
    only where given; empty where the side has no row there."""
    errors, n = median_errors(pooled.get("real", {}), pooled.get(name, {}), traffic)
    if not n:
        return []
    if traffic is not None:
        judged = [r for r in judged if traffic_of(point_of(r)) == traffic]
    _, agreed, decided, _ = ranking_table(judged, pooled, name)
    met = all(errors[m] <= goal for m, goal in GOALS.items())
    return [n, *(f"{errors[m]:.0%}" + (" *" if errors[m] > goal else "") for m, goal in GOALS.items()),
            f"{agreed} of {decided}" if decided else "-", "yes" if met else "no"]


def _by_traffic(sides: Sequence[tuple[str, str, Sequence[dict[str, Any]], dict[str, dict[str, Any]]]],
                rows: Sequence[dict[str, Any]], replicas: int, model_path: str | None) -> list[str]:
    """The goals' table again per traffic (workload and arrivals), with the machine's speed over that traffic's
    real runs, where a run has more than one: a miss under bursts and a hit under Poisson do not average out."""
    traffics = sorted({traffic_of(point_of(r)) for r in rows if r["side"] == "real" and r["workload"] != "chat"})
    if len(traffics) < 2:
        return []
    body: list[list[object]] = []
    for traffic in traffics:
        ratios = speed_ratios([r for r in rows if traffic_of(point_of(r)) == traffic], replicas, model_path)
        speed = f"{np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        body += [[traffic, f"`{name}`", speed, *row] for name, _, judged, pooled in sides
                 if (row := _goal_row(name, judged, pooled, traffic))]
    return ["By traffic: the same medians over each traffic's rows, beside the real engines' step over the "
            "calibrated model in that traffic's runs (median, range).", "",
            markdown_table(["traffic", "side", "engines / model", "rows", *GOALS, "decided pairs ordered alike",
                            "error goals met"], body), ""]
