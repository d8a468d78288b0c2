"""`bench.round_probe` against a SIMULATED replica (`sim serve --config` of the tiny model's calibration): the closed
loop, its JSON, and its errors. The real replica's runs are in docs/sim.md's notebook."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.round_probe import Round, main
from bench.sim_vs_real import serve_sim
from deploy.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "docs" / "bench" / "sim_vs_real_replica_slowsteps_2026-11-29.json"


def test_a_closed_loop_splits_its_first_tokens_and_a_full_budget_makes_requests_queue(
        tmp_path: Path, tiny_tokenizer: str) -> None:
    """B = 2 and B = 16 clients, 2 requests each: every request counted, vLLM's parts add up to its TTFT, the
    client's TTFT is no shorter, and 16 prompts of 256 tokens started together (4,096 tokens against a budget of
    2,048 a step) wait in vLLM's queue where 2 do not."""
    out = tmp_path / "rounds.json"
    with ExitStack() as stack:
        urls, _ = serve_sim(stack, str(MODEL), 1, free_ports(1), tmp_path / "sim.log", tiny_tokenizer)
        assert main(["--replica", urls[0], "--batch-sizes", "2,16", "--reps", "1", "--requests", "2",
                     "--output", "8", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["workload"] == {"prompt": 256, "output": 8, "requests": 2}
    small, large = record["runs"]
    assert (small["batch_size"], small["requests"], large["batch_size"], large["requests"]) == (2, 4, 16, 32)
    for run in (small, large):
        assert run["prefill_ms"] > 0
        assert run["api_server_ms"] == pytest.approx(run["ttft_ms"] - run["queue_ms"] - run["prefill_ms"])
        assert run["client_ttft_mean_ms"] >= run["ttft_ms"] * 0.95
        assert run["outside_ms"] == pytest.approx(run["client_ttft_mean_ms"] - run["ttft_ms"])
    assert small["queue_ms"] < 1.0 < large["queue_ms"]
    assert large["client_ttft_mean_ms"] > small["client_ttft_mean_ms"]


def test_an_unreachable_replica_and_bad_arguments_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--replica", "http://127.0.0.1:9"]) == 1
    assert "bench.round_probe: http://127.0.0.1:9:" in capsys.readouterr().err
    for bad in (["--reps", "0"], ["--batch-sizes", "4,x"], ["--batch-sizes", "0"], ["--output", "1"],
                ["--requests", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["--replica", "http://127.0.0.1:9", *bad])
        assert exc.value.code == 2
    run = Round(16, 64, 430.0, 420.0, 410.0, 97.0, 230.0)
    assert (run.api_server_ms, run.outside_ms) == (pytest.approx(83.0), pytest.approx(20.0))
