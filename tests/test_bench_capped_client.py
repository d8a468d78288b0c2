"""bench.capped_client's reading of stored closed-loop points (fast: made-up point files; the calibration it runs
is tests/test_sim_fromprofile.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.capped_client import counts_report, main, measured_counts, pool_rows, relabelled, simulated_counts


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


def test_the_counts_are_read_as_they_held_beside_the_simulator(tmp_path: Path) -> None:
    """One client process: 100 streams over 1 or 2 replicas (the same total); one per replica: 100 each. The
    steady rate where a count has one. The simulator's counts: two replicas at 100 each make more than one at 100,
    and more than two at 50 each."""
    counts = tmp_path / "run" / "points" / "replicas"
    counts.mkdir(parents=True)
    for name, tok in (("k1", 40000.0), ("k2", 30000.0), ("gateway-k1", 42000.0), ("gateway-k2", 50400.0),
                      ("direct-k1", 44000.0), ("direct-k2", 55000.0)):
        (counts / f"{name}.json").write_text(json.dumps({"total_tok_s": tok - 500, "steady_tok_s": tok}))
    measured = measured_counts(tmp_path / "run")
    assert measured["one client k2"] == 30000.0 and measured["straight k1"] == 44000.0
    simulated = simulated_counts("opt-1.3b", 256, 128)
    assert set(simulated) == {"1 x 100", "2 x 50", "2 x 100", "1 x 200"}
    assert simulated["2 x 100"] > simulated["1 x 100"] > 0 and simulated["2 x 100"] > simulated["2 x 50"]
    text = counts_report([{"run": "run", "model": "opt-1.3b", "measured": measured, "simulated": simulated}])
    assert "| run | -25% |" in text and "| +20%, +25% |" in text
