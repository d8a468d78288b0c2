"""`bench.burst_probe` against a SIMULATED replica (`sim serve --config` of the tiny model's calibration): the probe
itself, its JSON, and its errors. The real replica's readings are in docs/sim.md's notebook."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.burst_probe import SHAPES, Reading, main
from bench.sim_vs_real import serve_sim
from deploy.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "docs" / "bench" / "sim_vs_real_replica_slowsteps_2026-11-29.json"


def test_a_burst_costs_more_than_a_prompt_alone_and_vllms_split_adds_up(tmp_path: Path) -> None:
    """Every shape read once: vLLM's TTFT is its API server's part + queue + prefill, the client's TTFT is no
    shorter, eight prompts together wait longer for their first token than one, and one of 1,024 tokens prefills
    longer than one of 128."""
    out = tmp_path / "probe.json"
    with ExitStack() as stack:
        urls, _ = serve_sim(stack, str(MODEL), 1, free_ports(1), tmp_path / "sim.log")
        assert main(["--replica", urls[0], "--reps", "1", "--out", str(out)]) == 0
    rows = {r["shape"]: r for r in json.loads(out.read_text())["readings"]}
    assert list(rows) == list(SHAPES)
    for r in rows.values():
        assert r["reps"] == 1 and r["prefill_ms"] > 0 and r["queue_ms"] >= 0
        assert r["api_server_ms"] == pytest.approx(r["ttft_ms"] - r["queue_ms"] - r["prefill_ms"])
        assert r["client_ttft_ms"] >= r["ttft_ms"] * 0.95
    assert rows["8 x 128"]["client_ttft_ms"] > rows["1 x 128"]["client_ttft_ms"]
    assert rows["1 x 1024"]["prefill_ms"] > 3 * rows["1 x 128"]["prefill_ms"]


def test_an_unreachable_replica_and_bad_reps_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--replica", "http://127.0.0.1:9"]) == 1
    assert "bench.burst_probe: http://127.0.0.1:9:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--replica", "http://127.0.0.1:9", "--reps", "0"])
    assert exc.value.code == 2
    assert Reading("1 x 128", 30.0, 25.0, 1.0, 22.0, 5).api_server_ms == pytest.approx(2.0)
