"""How far a calibration's profile rounds differ: the noise a single round puts into the replica model.

With `--calibration-rounds R` each calibration's profiles are taken R times: round 0 before the real runs, the
others spread over them, so the rounds sample the minutes the real side ran in. `sim calibrate` fits the
point-by-point median round (`sim.fromprofile.median_of_rounds`). This section lists, per profile and batch size, the
first replica's TPOT mean in every round, the largest over the smallest, and the round the fit took; then, per
point of the real runs, the fitted model and each round's model fitted alone (what one round would have given)
evaluated at the real engines' own batch (`bench.sim_vs_real_steps`), against the real engines' mean step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import PlannerError
from planner.sources import load_profile
from sim.fromprofile import median_round
from sim.measured import ReplicaModel

from .common import markdown_table
from .sim_vs_real_ranking import point_of
from .sim_vs_real_steps import model_ms, per_run


def rounds_lines(dirs: Sequence[Sequence[Path]], title: str) -> list[str]:
    """The section for one calibration: `dirs[i][k]` is profile i's round k (the first replica's directory)."""
    body = []
    for profile_rounds in dirs:
        try:
            profiles = [load_profile(d) for d in profile_rounds]
        except PlannerError:  # a round not taken (a run stopped before it): nothing to compare
            return []
        work = profiles[0].context.workload
        for k, point in enumerate(profiles[0].points):
            tpot = [p.points[k].tpot_ms.mean or 0.0 for p in profiles]
            body.append([f"{work.input_tokens} + {work.output_tokens}", str(point.batch_size),
                         *(f"{t:.2f}" for t in tpot), f"{max(tpot) / min(tpot):.2f}" if min(tpot) else "",
                         str(median_round(tpot))])
    if not body or len(dirs[0]) < 2:
        return []
    count = len(dirs[0])
    return [f"## Calibration rounds ({title})", "",
            f"TPOT mean (ms) of the first replica at each profile point, in each of {count} rounds (round 0 before "
            "the real runs, the others spread over them); the fit takes, point by point, the median round.", "",
            markdown_table(["tokens", "B", *(f"round {k}" for k in range(count)), "largest / smallest", "fitted"],
                           body), ""]


def models_lines(rows: Sequence[dict[str, Any]], replicas: int, fitted: str, rounds: Sequence[str]) -> list[str]:
    """Per single-turn point of the real runs: the real engines' mean step (median over the runs), and the fitted
    model and each round's model at the real engines' batch, as model / real - 1."""
    models = [ReplicaModel.load(path) for path in (fitted, *rounds)]
    cells: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        figures = per_run(r, replicas) if r["side"] == "real" and r["workload"] != "chat" else None
        if figures:
            cells.setdefault(point_of(r), []).append(figures)
    body = []
    for point, runs in sorted(cells.items()):
        real = float(np.median([ms for _, ms, _ in runs]))
        at_real = [float(np.median([model_ms(m, b, p) for b, _, p in runs])) for m in models]
        body.append([point, str(len(runs)), f"{real:.2f}", *(f"{v / real - 1:+.0%}" for v in at_real)])
    if not body:
        return []
    return ["Each model at the real engines' own batch and prompt tokens a step (median over the point's real "
            "runs), against the real engines' mean step (model / real - 1):", "",
            markdown_table(["point", "runs", "ms a step, real", "fitted (median round)",
                            *(f"round {k} alone" for k in range(len(rounds)))], body), ""]
