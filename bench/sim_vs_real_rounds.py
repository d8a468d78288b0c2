"""How far a calibration's profile rounds differ: the noise a single round puts into the replica model.

With `--calibration-rounds R` each calibration's profiles are taken R times: round 0 before the real runs, the
others spread over them, so the rounds sample the minutes the real side ran in. `sim calibrate` fits the
point-by-point median round (`sim.fromprofile.median_of_rounds`). This section lists, per profile and batch size, the
first replica's TPOT mean in every round, the largest over the smallest, and the round the fit took.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from planner.errors import PlannerError
from planner.sources import load_profile

from .common import markdown_table


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
            chosen = sorted(range(len(tpot)), key=tpot.__getitem__)[(len(tpot) - 1) // 2]
            body.append([f"{work.input_tokens} + {work.output_tokens}", str(point.batch_size),
                         *(f"{t:.2f}" for t in tpot), f"{max(tpot) / min(tpot):.2f}" if min(tpot) else "",
                         str(chosen)])
    if not body or len(dirs[0]) < 2:
        return []
    count = len(dirs[0])
    return [f"## Calibration rounds ({title})", "",
            f"TPOT mean (ms) of the first replica at each profile point, in each of {count} rounds (round 0 before "
            "the real runs, the others spread over them); the fit takes, point by point, the median round.", "",
            markdown_table(["tokens", "B", *(f"round {k}" for k in range(count)), "largest / smallest", "fitted"],
                           body), ""]
