"""`python -m bench.gpu_replication --quick` end to end on REAL vLLM (CPU) with the tiny model: the frontier on
one instance and its prefill cost, `planner plan`, 1..2 replicas through the gateway (one client, then one per
replica) and straight, the routing policies under a real Locust run, the report (the simulator calibrated from the
frontier among it); then the same command again measures nothing (every point is on disk)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.ports import free_ports
from planner.sources import load_profile

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_end_to_end_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "quick"
    command = [sys.executable, "-m", "bench.gpu_replication", "--quick", "--out", str(out), "--port", str(free_ports(51)),
               "--gateway-workers", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    profile = load_profile(out / "frontier")
    assert [p.batch_size for p in profile.points] == [2, 8]
    assert all(p.total_tok_s > 0 and p.failed_requests == 0 and p.gpu is None for p in profile.points)
    cost = json.loads((out / "points" / "frontier" / "prefill_cost.json").read_text())  # bench.prefill_cost's
    assert [(r["cached"], r["new"]) for r in cost["readings"]] == [(0, 128), (0, 384), (256, 128)]  # fit 512
    assert all(r["prefill_ms"] > 0 and r["reps"] == 2 for r in cost["readings"])
    assert cost["readings"][2]["hit_tokens"] > 0 and isinstance(cost["fit"]["per_pair_s"], float)
    plan = json.loads((out / "points" / "plan" / "plan.json").read_text())
    assert plan["b_star"] in (2, 8) and plan["measured_replicas"] == 2
    for k in (1, 2):
        count = json.loads((out / "points" / "replicas" / f"k{k}.json").read_text())
        assert count["replicas"] == k and count["concurrency"] == k * plan["b_star"]
        assert count["total_tok_s"] > 0 and count["failed_requests"] == 0
        assert count["cpu_cores"]["gateway"] > 0 and count["cpu_cores"]["engines"] > 0
        assert count["cpu_cores"]["bench_process"] > 0  # where validate's one client ran
        assert count["steady_tok_s"] > 0 and count["steady_s"] > 0  # two waves: a steady part between them
    for k in (1, 2):  # the same replicas with one client process each: through the gateway, and straight
        through = json.loads((out / "points" / "replicas" / f"gateway-k{k}.json").read_text())
        straight = json.loads((out / "points" / "replicas" / f"direct-k{k}.json").read_text())
        assert through["replicas"] == k and len(through["per_client_tok_s"]) == k and through["failed"] == [0] * k
        assert through["cpu_cores"]["gateway"] > 0 and through["cpu_cores"]["clients"] > 0
        assert straight["replicas"] == k and len(straight["per_replica_tok_s"]) == k
        assert straight["total_tok_s"] > 0 and straight["failed"] == [0] * k
        assert straight["steady_tok_s"] > 0 and straight["cpu_cores"]["clients"] > 0
        assert straight["cpu_cores"]["api_servers"] > 0 and straight["cpu_cores"]["engines"] > 0
    decision = json.loads((out / "points" / "replicas" / "decision.json").read_text())
    assert decision["decision"].startswith(f"keep {decision['best_replicas']} replica")
    assert "NVIDIA GPU" in json.loads((out / "points" / "mps" / "unavailable.json").read_text())["reason"]
    for name in ("single-load0.9", "lot-load0.9", "rr-load0.9"):
        point = json.loads((out / "points" / "routing" / f"{name}.json").read_text())
        assert point["summary"]["completed"] > 0 and point["summary"]["failed"] == 0
        assert point["summary"]["median_ttft_ms"] > 0 and point["summary"]["median_itl_ms"] > 0
        assert (out / "loadtest" / name / "records.jsonl").stat().st_size > 0  # a real Locust run wrote them
    text = (out / "summary.md").read_text()
    assert "CPU run" in text and "14,669 (+35%)" in text and decision["decision"] in text
    calibrated = text.split("## The simulator calibrated from this frontier")[1]  # sim calibrate on the frontier
    assert "max_num_seqs 8, max_num_batched_tokens 2048, chunked_prefill True" in calibrated
    assert "| 32 + 16 | 2 |" in calibrated and "| 32 + 16 | 8 |" in calibrated
    for figure in ("fig1_frontier.png", "fig5_replicas.png", "fig4_routing.png", "fig6_gpu.png"):
        assert (out / figure).stat().st_size > 10_000
    assert "workers: 2" in (out / "run" / "gw-lot" / "gateway.yaml").read_text()  # --gateway-workers reached it
    steps = {row["step"] for row in json.loads((out / "timings.json").read_text())}
    assert steps == {"frontier", "plan", "replicas", "mps", "report"}

    started = time.monotonic()
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "frontier: every point is measured already" in again.stdout
    assert "replicas: every point is measured already" in again.stdout
    assert "starting" not in again.stdout and time.monotonic() - started < 60  # no vLLM was started
