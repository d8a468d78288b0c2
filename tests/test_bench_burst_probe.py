"""`bench.burst_probe` against a SIMULATED replica (`sim serve --config` of the tiny model's calibration): the probe
itself, its JSON, and its errors. The real replica's readings are in docs/sim.md's notebook."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.burst_probe import LOADED_SHAPES, SHAPES, Reading, main
from bench.engine_speed import counters
from bench.sim_vs_real import serve_sim
from deploy.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
RUNNING = "vllm:num_requests_running"
MODEL = ROOT / "docs" / "bench" / "sim_vs_real_replica_slowsteps_2026-11-29.json"


def test_a_burst_costs_more_than_a_prompt_alone_and_vllms_split_adds_up(tmp_path: Path, tiny_tokenizer: str) -> None:
    """Every shape read once: vLLM's TTFT is its API server's part + queue + prefill, the client's TTFT is no
    shorter, eight prompts together wait longer for their first token than one, and one of 1,024 tokens prefills
    longer than one of 128."""
    out = tmp_path / "probe.json"
    with ExitStack() as stack:
        urls, _ = serve_sim(stack, str(MODEL), 1, free_ports(1), tmp_path / "sim.log", tiny_tokenizer)
        assert main(["--replica", urls[0], "--reps", "1", "--out", str(out)]) == 0
    rows = {r["shape"]: r for r in json.loads(out.read_text())["readings"]}
    assert list(rows) == list(SHAPES)
    for r in rows.values():
        assert r["reps"] == 1 and r["prefill_ms"] > 0 and r["queue_ms"] >= 0
        assert r["api_server_ms"] == pytest.approx(r["ttft_ms"] - r["queue_ms"] - r["prefill_ms"])
        assert r["client_ttft_ms"] >= r["ttft_ms"] * 0.95
    assert rows["8 x 128"]["client_ttft_ms"] > rows["1 x 128"]["client_ttft_ms"]
    assert rows["1 x 1024"]["prefill_ms"] > 3 * rows["1 x 128"]["prefill_ms"]


def test_under_streaming_load_a_prompt_waits_for_the_steps_of_the_streams(tmp_path: Path, tiny_tokenizer: str) -> None:
    """`--background 0,8`: with 8 requests streaming, the engine steps (a step per background token, about one a
    token a chunk), and a prompt's prefill shares its step with their decode, so it takes longer than alone; the
    streams end with the probe (the replica runs nothing after it)."""
    out = tmp_path / "loaded.json"
    with ExitStack() as stack:
        urls, _ = serve_sim(stack, str(MODEL), 1, free_ports(1), tmp_path / "sim.log", tiny_tokenizer)
        assert main(["--replica", urls[0], "--background", "0,8", "--reps", "1", "--out", str(out)]) == 0
        deadline = time.monotonic() + 10
        while counters(urls, (RUNNING,))[RUNNING] and time.monotonic() < deadline:
            time.sleep(0.1)  # the replica sees the dropped connections a moment later
        assert counters(urls, (RUNNING,))[RUNNING] == 0
    idle, loaded = json.loads(out.read_text())["loaded"]
    assert (idle["background"], loaded["background"]) == (0, 8)
    assert idle["step_ms"] is None and idle["tokens_a_chunk"] is None
    assert 5 < loaded["step_ms"] < 100 and loaded["tokens_a_chunk"] == pytest.approx(1.0, abs=0.2)
    for case in (idle, loaded):
        assert [r["shape"] for r in case["readings"]] == list(LOADED_SHAPES)
        for r in case["readings"]:
            assert r["api_server_ms"] == pytest.approx(r["ttft_ms"] - r["queue_ms"] - r["prefill_ms"])
    alone, shared = (next(r for r in case["readings"] if r["shape"] == "1 x 128") for case in (idle, loaded))
    assert shared["prefill_ms"] > alone["prefill_ms"]


def test_an_unreachable_replica_and_bad_reps_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--replica", "http://127.0.0.1:9"]) == 1
    assert "bench.burst_probe: http://127.0.0.1:9:" in capsys.readouterr().err
    for bad in (["--reps", "0"], ["--background", "4,x"], ["--background", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(["--replica", "http://127.0.0.1:9", *bad])
        assert exc.value.code == 2
    assert Reading("1 x 128", 30.0, 25.0, 1.0, 22.0, 5).api_server_ms == pytest.approx(2.0)
