"""bench/ttft_by_length.py: requests rebuilt from their spans, split by prompt length, and set beside a replica
model (made-up spans; the real run is the bench's own, docs/sim.md "Where a long prompt's time goes")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.otlp_collector import Span
from bench.ttft_by_length import (Request, against_model, by_length, main, prefill_work, report,
                                  requests_from_spans, robust_fit)
from sim.measured import ReplicaModel

MODEL = ReplicaModel("m", step_s=((1, 0.010), (8, 0.020)), prefill_s_per_token=1e-4, frontend_s=0.0, max_num_seqs=8,
                     max_num_batched_tokens=2048, chunked_prefill=True, prefix_caching=True, block_size=16,
                     num_blocks=1000, max_model_len=2048, prefill_s_per_pair=1e-8)


def spans(trace: str, replica: str, prompt: int, at_ms: float, ttft_ms: float, prefill_ms: float,
          e2e_ms: float = 500.0, gateway_extra_ms: float = 6.0, to_vllm_ms: float = 3.0) -> list[Span]:
    """One request's three spans: the gateway's receipt at `at_ms`, its send 0.2 ms later, vLLM's arrival
    `to_vllm_ms` after that."""
    ns = 1_000_000
    sent, arrival = at_ms + 0.2, at_ms + 0.2 + to_vllm_ms
    gateway_ttft = (arrival - at_ms + ttft_ms + gateway_extra_ms) / 1e3
    return [
        Span("gw", "gateway.request", trace, f"{trace}-r", "", 2,
             {"gen_ai.latency.time_to_first_token": gateway_ttft}, (), False, int(at_ms * ns), int((at_ms + 9) * ns)),
        Span("gw", "gateway.upstream", trace, f"{trace}-u", f"{trace}-r", 3, {"gateway.replica": replica}, (), False,
             int(sent * ns), int((sent + 9) * ns)),
        Span("vllm", "llm_request", trace, f"{trace}-v", f"{trace}-u", 2,
             {"gen_ai.usage.prompt_tokens": prompt, "gen_ai.usage.completion_tokens": 32,
              "gen_ai.latency.time_to_first_token": ttft_ms / 1e3, "gen_ai.latency.time_in_model_prefill":
              prefill_ms / 1e3, "gen_ai.latency.e2e": e2e_ms / 1e3, "gen_ai.latency.time_in_queue": 0.0}, (), False,
             int(arrival * ns), int((arrival + e2e_ms) * ns)),
    ]


def test_each_request_is_rebuilt_from_its_three_spans_and_its_parts_add_up() -> None:
    found = requests_from_spans([*spans("a", "r0", 128, 0.0, 40.0, 25.0),
                                 *spans("b", "r1", 1024, 100.0, 150.0, 130.0),
                                 *spans("c", "r0", 128, 200.0, 40.0, 25.0)[:2],  # vLLM's span lost: left out
                                 *spans("d", "r0", 128, 300.0, 40.0, 25.0),
                                 spans("d", "r1", 128, 300.0, 40.0, 25.0)[1]])  # retried: two replicas, left out
    assert [(r.replica, r.prompt_tokens) for r in found] == [("r0", 128), ("r1", 1024)]
    a = found[0]
    parts = a.parts()
    assert parts["to_vllm"] == pytest.approx(0.003) and parts["prefill"] == pytest.approx(0.025)
    assert parts["to_first_step"] == pytest.approx(0.015) and parts["out"] == pytest.approx(0.006)
    assert sum(parts.values()) + 0.0002 == pytest.approx(a.gateway_ttft)  # the pick: receipt to send
    split = by_length(found)
    assert set(split) == {128, 1024} and split[1024]["requests"] == 1
    assert split[1024]["prefill"] == pytest.approx(0.130) and split[1024]["gateway_ttft"] == pytest.approx(0.1592)


def test_the_fit_recovers_how_much_slower_than_the_model_the_prefill_ran() -> None:
    """Prefills made 1.0 x the model's step + 1.5 x its prefill work (one an outlier) are fitted back so; a prefill
    overlapped by another prompt's on its replica is left out."""
    requests, at = [], 0.0
    for i in range(12):
        prompt = (128, 1024)[i % 2]
        prefill = (MODEL.step(1) + 1.5 * prefill_work(MODEL, prompt)) * (3.0 if i == 5 else 1.0)
        requests.append(Request("r0", prompt, 32, at, at + 0.003, prefill + 0.02, at - 0.0002, prefill + 0.01,
                                prefill, prefill + 0.05))
        at += 1.0
    requests.append(Request("r0", 128, 32, 4.01, 4.012, 0.05, 4.0098, 0.04, 0.03, 0.1))  # overlaps the fifth's
    s_step, s_prefill = robust_fit([(r, MODEL.step(1), prefill_work(MODEL, r.prompt_tokens)) for r in requests[:12]])
    assert s_step == pytest.approx(1.0, abs=0.05) and s_prefill == pytest.approx(1.5, abs=0.05)
    judged = against_model(requests, MODEL)
    assert judged["alone"] == 11  # the overlapping pair is out: each had the other's prompt in its span
    assert judged["ratio"]["1024"] > judged["ratio"]["128"] > 1.0
    assert judged["s_prefill"] == pytest.approx(1.5, abs=0.05)
    assert all(isinstance(x, float) for x in robust_fit([]))


def test_the_report_and_its_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = Request("r0", 1024, 32, 0.0, 0.003, 0.2, -0.0002, 0.19, 0.15, 1.0)
    row = {"load": 0.5, "seed": 0, "rate": 5.0, "completed": 1, "failed": 0, "traced": 1, "speed_us": 21000.0,
           "by_length": {"1024": by_length([request])[1024]}, "requests": [request.__dict__]}
    (tmp_path / "runs.jsonl").write_text(json.dumps(row) + "\n")
    model_path = tmp_path / "model.json"
    model_path.write_text(MODEL.to_json())
    main(["--out", str(tmp_path), "--report", "--model", str(model_path)])
    text = (tmp_path / "report.md").read_text()
    assert "| 0.5 | 0 | 21.0 | 1024 | 1 | 200.0 |" in text and "## The prefill against the model" in text
    assert "| 0.5 | 0 | 21.0 | 1 |" in text  # one prefill alone on its replica
    assert report([row], None).count("\n|") == 3  # the header, its rule and one row: no model table
    for argv, message in ((["--out", str(tmp_path / "none"), "--report"], "no "),
                          (["--out", str(tmp_path), "--loads", "0.5,x"], "--loads must be numbers"),
                          (["--out", str(tmp_path), "--loads", "3"], "in (0, 2]"),
                          (["--out", str(tmp_path), "--seeds", "0"], "at least 1"),
                          (["--out", str(tmp_path), "--model", str(tmp_path / "missing.json")], "cannot read")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
