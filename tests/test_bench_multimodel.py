"""bench.multimodel's quick mode: the packing against the alternatives in the simulator, and the split figure."""

from __future__ import annotations

import json
from pathlib import Path

from bench.multimodel import main


def test_quick_mode_writes_the_comparison_and_the_figures(tmp_path: Path) -> None:
    """Every arrangement and split point is simulated; at the stated traffic the packed plan meets its goals."""
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "multimodel.json").read_text())
    assert set(result["compare"]) == {"packed", "equal_split", "one_replica_each"}
    assert result["compare"]["packed"]["1.0"]["within_goal"] >= 0.99
    assert [row["share"] for row in result["split"]["sweep"]] == [0.3, 0.5, 0.7]
    assert 0 < result["split"]["planned_share"] < 1
    assert (tmp_path / "multimodel-split.png").stat().st_size > 10_000
    assert (tmp_path / "multimodel-compare.png").stat().st_size > 10_000
