"""`planner validate` with FAKE replicas behind the real gateway: counts measured, best kept, plan rewritten."""

from __future__ import annotations

import contextlib
import csv
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from deploy.launch import gateway_config
from deploy.plan import Admission, GatewaySpec, Plan, ReplicaSpec, load
from deploy.process import ManagedProcess
from planner.errors import PlannerError
from planner.points import Latency
from deploy.ports import free_ports
from planner.stats import RunSummary
from planner.validate import CountResult, ValidateConfig, Validator, best_count, explain_best, sub_plan
from planner.workload import ApproximatePrompts, FixedLengths

REPLICATION = Path(__file__).resolve().parent.parent / "planner" / "data" / "bca-opt-1.3b-h100-replication.csv"


def summary(tok_s: float) -> RunSummary:
    return RunSummary(num_requests=10, failed_requests=0, duration_s=1.0, req_s=1.0, output_tok_s=tok_s / 2,
                      total_tok_s=tok_s, mean_input_tokens=1.0, ttft_ms=Latency(), tpot_ms=Latency(),
                      itl_ms=Latency(), e2e_ms=Latency())


def test_best_count_on_the_papers_replication_keeps_two() -> None:
    """At B=256: 1 -> 10871, 2 -> 14669, 4 -> 14720 tok/s; four add 0.3%, so two are kept."""
    with REPLICATION.open() as f:
        rows = [r for r in csv.DictReader(line for line in f if not line.startswith("#"))
                if r["max_num_seqs"] == "256"]
    results = [CountResult(int(r["replicas"]), 256 * int(r["replicas"]), summary(float(r["total_tok_s"])))
               for r in rows]
    assert [r.replicas for r in results] == [1, 2, 4]
    assert best_count(results, 0.05).replicas == 2
    assert best_count(results, 0.0).replicas == 4


def test_where_replication_does_not_pay_one_replica_is_kept_and_the_plan_says_why() -> None:
    """Today's vLLM may leave no headroom: 2 and 3 replicas adding +2% and -4% keep one, with the reason."""
    results = [CountResult(k, 64 * k, summary(tok)) for k, tok in ((1, 10000.0), (2, 10200.0), (3, 9600.0))]
    best = best_count(results, 0.05)
    assert best.replicas == 1
    assert explain_best(results, best, 0.05) == (
        "keep 1 replica(s): replication does not pay here. Over 1 (10000 tokens/s), 2 replicas +2.0%, "
        "3 replicas -4.0%: less than the 5% it takes to be worth another replica's memory")
    paper = [CountResult(k, 256 * k, summary(tok)) for k, tok in ((1, 10871.0), (2, 14669.0), (4, 14720.0))]
    assert explain_best(paper, best_count(paper, 0.05), 0.05).startswith(
        "keep 2 replicas (+34.9% over 1): 4 gave 14720 tokens/s, within 5% of it")
    assert explain_best(paper, best_count(paper, 0.0), 0.0).startswith("keep 4 replicas: the highest throughput")


def plan(n: int, model: str = "fake-model") -> Plan:
    ports = [free_ports() for _ in range(n + 1)]
    replicas = tuple(ReplicaSpec(name=f"r{i}", model=model, port=ports[i + 1], max_num_seqs=4,
                                 cpu_kvcache_space_gib=1.0, admission=Admission(max_requests=4)) for i in range(n))
    return Plan(model=model, replicas=replicas, gateway=GatewaySpec(port=ports[0], queue_size=64),
                reasoning={"batch": {"b_star": 4}})


def test_sub_plan_cuts_replicas_and_rejects_bad_counts() -> None:
    """A sub-plan keeps the first k replicas as they are; counts outside 1..N are user errors."""
    full = plan(3)
    assert sub_plan(full, 2).replicas == full.replicas[:2]
    with pytest.raises(PlannerError, match="replica count 4 is outside 1..3"):
        sub_plan(full, 4)


class FakeDeployer:
    """Deploys a plan as FAKE replicas (subprocesses) behind the real gateway, configured as deploy would."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.deployed: list[int] = []

    @contextlib.contextmanager
    def deploy(self, plan: Plan, label: str) -> Iterator[str]:
        self.deployed.append(len(plan.replicas))
        config = self.tmp_path / f"{label}-gateway.yaml"
        config.write_text(yaml.safe_dump(gateway_config(plan, host="127.0.0.1")))
        url = f"http://127.0.0.1:{plan.gateway.port}"
        with contextlib.ExitStack() as stack:
            for spec in plan.replicas:
                argv = [sys.executable, "-m", "tests.fake_replica", "--port", str(spec.port), "--itl", "0.01",
                        "--model", spec.model]
                stack.enter_context(ManagedProcess(spec.name, argv, self.tmp_path / f"{label}-{spec.name}.log",
                                                   f"http://127.0.0.1:{spec.port}/health", startup_timeout_s=30))
            argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
            stack.enter_context(ManagedProcess("gateway", argv, self.tmp_path / f"{label}-gateway.log",
                                               f"{url}/ready", startup_timeout_s=30))
            yield url


def test_validate_measures_each_count_and_keeps_the_best(tmp_path: Path) -> None:
    """Two fake replicas serve twice the concurrency at the same pace: two are kept, the table is written."""
    full = plan(2)
    deployer = FakeDeployer(tmp_path)
    workload = FixedLengths(8, 6, ApproximatePrompts())
    validated, results = Validator(full, ValidateConfig(counts=(1, 2), num_requests=24, warmup_requests=1),
                                   deployer, workload, out=lambda line: None).run()
    assert deployer.deployed == [1, 2]
    assert [(r.replicas, r.concurrency, r.summary.failed_requests) for r in results] == [(1, 4, 0), (2, 8, 0)]
    one, two = (r.summary.total_tok_s for r in results)
    assert two > 1.5 * one  # twice the slots at the same pace
    assert validated.validation["best_replicas"] == 2 and len(validated.replicas) == 2
    rows = validated.validation["counts"]
    assert [row["replicas"] for row in rows] == [1, 2] and rows[0]["gain_vs_fewest"] == 0.0
    assert validated.validation["workload"]["input_tokens"] == 8
    assert validated.validation["client_processes"] == {1: 1, 2: 2}  # one client process per replica
    assert validated.reasoning == full.reasoning


def test_validate_cli_writes_the_comparison_into_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`planner validate --plan` rewrites the plan with `validation` and the kept replicas, and draws Figure 5."""
    from deploy.plan import dump
    from planner import validate
    from planner.cli import main

    path = tmp_path / "plan.yaml"
    full = plan(2)
    dump(Plan(model=full.model, replicas=full.replicas, gateway=full.gateway,
              reasoning={"workload": {"kind": "fixed", "input_tokens": 8, "output_tokens": 4, "source": None}}), path)
    monkeypatch.setattr(validate, "SubprocessDeployer", lambda **kw: FakeDeployer(tmp_path))
    code = main(["validate", "--plan", str(path), "--num-requests", "16", "--min-gain", "0.99",
                 "--plots", str(tmp_path / "plots")])
    assert code == 0
    validated = load(path)
    assert validated.validation["best_replicas"] == 1 and len(validated.replicas) == 1  # min-gain 0.99: fewest
    assert validated.validation["workload"]["output_tokens"] == 4
    assert (tmp_path / "plots" / "replicas.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "best: 1 replica(s) of 2 planned" in printed and validated.validation["decision"] in printed
    assert validated.validation["decision"].startswith("keep 1 replica(s)")
