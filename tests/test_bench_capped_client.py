"""bench.capped_client's reading of stored closed-loop points (fast: made-up point files; the calibration it runs
is tests/test_sim_fromprofile.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.capped_client import main, pool_rows, relabelled


def point(folder: Path, batch: int, req_s: float, ttft_mean_ms: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    body = {"batch_size": batch, "req_s": req_s, "ttft_ms": {"mean": ttft_mean_ms, "p50": 200.0, "p99": 900.0},
            "metrics_missed": 4}
    (folder / f"point-b{batch:05d}.json").write_text(json.dumps({"schema": 1, "point": body}))


def test_points_past_100_get_their_wait_for_a_connection_by_littles_law(tmp_path: Path) -> None:
    """B = 256 at 120 req/s: 156 requests waiting, 1.3 s each on average; B = 64 had no wait to read."""
    point(tmp_path / "run" / "frontier", 64, 100.0, 150.0)
    point(tmp_path / "run" / "frontier", 256, 120.0, 1400.0)
    (row,) = pool_rows(tmp_path)
    assert row["point"] == "run/frontier/point-b00256.json" and row["metrics_missed"] == 4
    assert row["pool_wait_ms"] == pytest.approx(1300.0) and row["ttft_over_wait"] == pytest.approx(1400 / 1300)


def test_relabelling_keeps_one_point_at_100_for_every_point_past_it(tmp_path: Path) -> None:
    """B = 256 becomes the point at 100 (its measurements unchanged); B = 512, also held at 100, is dropped."""
    src = tmp_path / "frontier"
    for batch, rate in ((16, 50.0), (256, 120.0), (512, 121.0)):
        point(src, batch, rate, 100.0)
    assert relabelled(src, tmp_path / "copy") == [16, 100]
    moved = json.loads((tmp_path / "copy" / "point-b00100.json").read_text())["point"]
    assert moved["batch_size"] == 100 and moved["req_s"] == 120.0
    assert sorted(p.name for p in src.iterdir()) == ["point-b00016.json", "point-b00256.json", "point-b00512.json"]


def test_a_missing_folder_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--gpu", str(tmp_path / "nowhere")])
    assert exc.value.code == 2 and "no such folder" in capsys.readouterr().err
