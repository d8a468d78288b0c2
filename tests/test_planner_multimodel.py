"""Several models on one device: the packing (pure), the models file, the plan it writes, and the errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.launch import gateway_config, with_models
from deploy.models import ResolvedModel
from deploy.plan import Plan, dump, load
from planner.cli import main
from planner.errors import PlannerError
from planner.multimodel import spec_from_dict
from planner.multiplan import make_multi_plan
from planner.packing import GIB, Demand, Goal, PackingError, SpeedPoint, erlang_c, headroom, p99_ttft_ms, pack

DATA = Path(__file__).resolve().parent.parent / "planner" / "data"


def point(batch: int, rps: float, ttft_ms: float, gib: float, device_s: float = 0.0) -> SpeedPoint:
    return SpeedPoint(batch, rps, ttft_ms, int(gib * GIB), device_s=device_s)


def test_erlang_c_matches_the_single_server_case() -> None:
    """With one server the chance to wait is the utilization; with many servers at the same load it is far less."""
    assert erlang_c(1, 0.7) == pytest.approx(0.7)
    assert erlang_c(32, 0.7 * 32) < 0.1
    assert erlang_c(4, 4.0) == 1.0


def test_predicted_ttft_grows_with_load_and_is_infinite_past_capacity() -> None:
    """The base TTFT at low load, more near capacity, inf beyond it; two replicas halve each one's load."""
    p = point(8, 10.0, 100.0, 1)
    assert p99_ttft_ms(p, 1, 1.0) == pytest.approx(100.0)
    assert p99_ttft_ms(p, 1, 9.5) > p99_ttft_ms(p, 1, 8.0) > 100.0
    assert p99_ttft_ms(p, 1, 10.0) == math.inf
    assert p99_ttft_ms(p, 2, 9.5) < p99_ttft_ms(p, 1, 9.5)


def test_headroom() -> None:
    """Without a goal: capacity / traffic; a goal below the base TTFT: 0; else between."""
    p = point(8, 10.0, 100.0, 1)
    assert headroom(p, 2, 5.0, Goal()) == pytest.approx(4.0)
    assert headroom(p, 1, 5.0, Goal(p99_ttft_ms=50)) == 0.0
    room = headroom(p, 1, 5.0, Goal(p99_ttft_ms=500))
    assert 1.0 < room < 2.0 and p99_ttft_ms(p, 1, 5.0 * room) == pytest.approx(500, rel=0.01)


def two_models(rate_a: float = 10.0, rate_b: float = 10.0) -> list[Demand]:
    goal = Goal(p99_ttft_ms=1000)
    a = Demand("a", rate_a, goal, (point(8, 10.0, 100, 2), point(32, 20.0, 300, 4)))
    b = Demand("b", rate_b, goal, (point(8, 5.0, 100, 1), point(32, 8.0, 300, 2)))
    return [a, b]


def test_pack_maximizes_the_least_headroom_within_memory() -> None:
    """Every model gets an option; the smallest headroom is the best any choice within the budget reaches."""
    demands = two_models()
    packing = pack(demands, 12 * GIB)
    assert packing.used_bytes <= 12 * GIB and packing.min_headroom >= 1
    # brute force over every pair of options
    from planner.packing import options
    best = max(min(x.headroom, y.headroom) for x in options(demands[0]) for y in options(demands[1])
               if x.memory_bytes + y.memory_bytes <= 12 * GIB)
    assert packing.min_headroom == pytest.approx(best)


def test_a_bigger_device_gives_more_headroom() -> None:
    """More memory: more replicas, more headroom."""
    assert pack(two_models(), 24 * GIB).min_headroom > pack(two_models(), 8 * GIB).min_headroom


def test_memory_shortfall_names_the_models_and_by_how_much() -> None:
    """Each fits alone but not together: the message says GiB short and the largest need."""
    with pytest.raises(PackingError, match=r"GiB short; the largest need is 'a'") as info:
        pack(two_models(rate_a=25, rate_b=12), 8 * GIB)
    assert "b 5.00 GiB" in str(info.value) and "x the stated traffic" in str(info.value)


def test_a_model_that_cannot_meet_its_goal_alone_is_named() -> None:
    """Too much traffic for even the whole device: that model, and what it would carry."""
    with pytest.raises(PackingError, match=r"model 'b' cannot meet p99 TTFT 1000 ms at 500 requests/s even alone"):
        pack(two_models(rate_b=500), 8 * GIB)


def test_a_goal_below_every_base_ttft_is_named() -> None:
    goal = Goal(p99_ttft_ms=50)
    with pytest.raises(PackingError, match=r"model 'a' cannot meet p99 TTFT 50 ms at any batch cap.*100 ms"):
        pack([Demand("a", 1.0, goal, (point(8, 10.0, 100, 2),))], 8 * GIB)


def test_the_device_time_bounds_the_packing() -> None:
    """Replicas on one GPU share its compute: the traffic's device time caps the common headroom."""
    goal = Goal()
    demands = [Demand("a", 10.0, goal, (point(8, 100.0, 10, 1, device_s=0.04),)),
               Demand("b", 10.0, goal, (point(8, 100.0, 10, 1, device_s=0.04),))]
    packing = pack(demands, 100 * GIB)
    assert packing.device_load == pytest.approx(0.8) and packing.min_headroom == pytest.approx(1.25)
    with pytest.raises(PackingError, match=r"compute cannot carry.*needs at least 1.20 x the device's time"):
        pack([Demand(d.name, 15.0, goal, d.points) for d in demands], 100 * GIB)


# -- the models file ----------------------------------------------------------------------------------------

def cpu_spec(**changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "device": "cpu", "memory_gib": 12, "cpus": 2, "slo": {"p99_ttft_ms": 1000},
        "models": [{"name": "chat", "model": "tiny", "profile": str(DATA / "tiny-opt-cpu.csv"),
                    "traffic": {"rate": 10, "input_tokens": 64, "output_tokens": 16}},
                   {"name": "embed", "model": "tiny-embed", "kind": "embed",
                    "profile": str(DATA / "tiny-embed-cpu.csv"), "traffic": {"rate": 20, "input_tokens": 116}}]}
    spec.update(changes)
    return spec


def with_model(index: int, **changes: Any) -> dict[str, Any]:
    spec = cpu_spec()
    spec["models"][index] = {**spec["models"][index], **changes}
    spec["models"][index] = {k: v for k, v in spec["models"][index].items() if v is not None}
    return spec


@pytest.mark.parametrize("spec, message", [
    (with_model(1, profile=None), r"model 'embed' has no profile"),
    (with_model(0, traffic=None), r"model 'chat' has no traffic"),
    (with_model(1, traffic={"rate": 5, "input_tokens": 10, "output_tokens": 4}),
     r"model 'embed': an embedding model generates no tokens"),
    (with_model(0, traffic={"rate": 5, "input_tokens": 10}), r"model 'chat': a generative model's traffic needs"),
    (with_model(0, traffic={"rate": -1, "input_tokens": 10, "output_tokens": 1}), r"model 'chat': traffic rate"),
    (with_model(0, kind="rerank"), r"model 'chat': kind must be one of generate, embed"),
    (with_model(0, slo={"p50_ttft_ms": 3}), r"model 'chat': unknown slo key"),
    (with_model(0, colour="red"), r"model 'chat': unknown key\(s\) colour"),
    (with_model(0, policy="fastest"), r"model 'chat': policy 'fastest'"),
    (cpu_spec(models=[]), r"non-empty list `models:`"),
])
def test_bad_models_file_names_the_model(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(PlannerError, match=message):
        spec_from_dict(spec)


def test_unreadable_profile_and_synthetic_on_cpu_name_the_model() -> None:
    with pytest.raises(PlannerError, match=r"model 'chat': profile .*does not exist"):
        make_multi_plan(spec_from_dict(with_model(0, profile="/nonexistent/profile")))
    with pytest.raises(PlannerError, match=r"model 'chat': a synthetic profile is a GPU estimate"):
        make_multi_plan(spec_from_dict(with_model(0, profile="synthetic:opt-125m")))


def test_traffic_from_a_recorded_load(tmp_path: Path) -> None:
    """A loadtest records.jsonl gives the rate (requests over the span) and the mean lengths."""
    lines = [{"index": i, "scheduled_s": i * 0.5, "sent_s": i * 0.5, "requested_prompt_tokens": 100,
              "prompt_tokens": 60 + 2 * (i % 2), "max_tokens": 20} for i in range(11)]
    (tmp_path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    spec = spec_from_dict(with_model(0, traffic={"load_file": "records.jsonl"}), tmp_path)
    traffic = spec.models[0].traffic
    assert traffic.rate == pytest.approx(2.0) and traffic.input_tokens == 61 and traffic.output_tokens == 20
    assert traffic.source.startswith("recorded:")


# -- the plan ------------------------------------------------------------------------------------------------

GPU_SPEC = {"gpu": "H100", "slo": {"p99_ttft_ms": 500}, "models": [
    {"name": "chat", "profile": "synthetic:qwen3-1.7b", "traffic": {"rate": 8, "input_tokens": 1024,
                                                                   "output_tokens": 256}},
    {"name": "code", "profile": "synthetic:llama-3.2-1b", "traffic": {"rate": 10, "input_tokens": 2048,
                                                                     "output_tokens": 128},
     "slo": {"p99_ttft_ms": 300}},
    {"name": "embed", "kind": "embed", "profile": "synthetic:qwen3-0.6b",
     "traffic": {"rate": 300, "input_tokens": 512}, "slo": {"p99_ttft_ms": 100}}]}


def test_gpu_plan_packs_every_model_into_the_usable_share(tmp_path: Path) -> None:
    """Memory shares sum to the usable 0.9, each model's replicas serve its name, the embedder pools."""
    result = make_multi_plan(spec_from_dict(GPU_SPEC))
    plan = result.plan
    assert sum(r.gpu_memory_utilization or 0 for r in plan.replicas) == pytest.approx(0.9, abs=0.002)
    assert {m.name for m in plan.models} == {"chat", "code", "embed"}
    for entry in plan.models:
        replicas = plan.replicas_of(entry.name)
        assert replicas and all(r.admission.max_requests == r.max_num_seqs for r in replicas)
        assert all(("--runner" in r.extra_args) == (entry.kind == "embed") for r in replicas)
    multimodel = plan.reasoning["multimodel"]
    assert multimodel["min_headroom"] >= 1 and multimodel["device_load"] <= 1
    assert multimodel["min_headroom"] >= multimodel["baselines"]["equal_split"]["min_headroom"]
    dump(plan, tmp_path / "plan.yaml")
    assert load(tmp_path / "plan.yaml") == plan


def test_a_one_model_plan_file_is_unchanged(tmp_path: Path) -> None:
    """Plans without models: write no `models:` key and read back as before."""
    plan = load_plan_text("model: m\nreplicas: [{name: r0, model: m, port: 8001}]\n", tmp_path)
    assert plan.models == () and "models" not in plan.to_dict()


def load_plan_text(text: str, tmp_path: Path) -> Plan:
    (tmp_path / "p.yaml").write_text(text)
    return load(tmp_path / "p.yaml")


def test_a_model_entry_without_replicas_is_refused(tmp_path: Path) -> None:
    from deploy.plan import PlanError
    with pytest.raises(PlanError, match=r"model 'x' has no replica in the plan"):
        load_plan_text("model: m\nreplicas: [{name: r0, model: m, port: 8001}]\nmodels: [{name: x}]\n", tmp_path)


def test_deploy_hands_each_models_settings_to_the_gateway() -> None:
    """gateway.yaml gets models: with each one's policy and queue; the embedder's replica gets the pooling runner."""
    plan = make_multi_plan(spec_from_dict(GPU_SPEC)).plan
    config = gateway_config(plan)
    assert config["models"]["embed"]["policy"] == "least_outstanding_tokens"
    assert config["models"]["chat"]["queue"]["max_size"] == plan.models[0].queue_size
    stripped = Plan(plan.model, tuple(r.__class__(**{**r.__dict__, "extra_args": ()}) for r in plan.replicas),
                    plan.gateway, models=plan.models)
    resolved = {r.model: ResolvedModel(r.model, r.model, None) for r in plan.replicas}
    deployed = with_models(stripped, resolved, gpu=True)
    embed = deployed.replicas_of("embed")[0]
    assert embed.extra_args == ("--runner", "pooling")


def test_cli_writes_the_plan_and_reports_errors_with_exit_2(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cpu_spec()))
    assert main(["plan", "--models", str(tmp_path / "models.yaml"), "--out", str(tmp_path / "plan.yaml")]) == 0
    assert "equal split" in capsys.readouterr().out
    plan = load(tmp_path / "plan.yaml")
    assert [r.served_model_name for r in plan.replicas] == ["chat", "embed"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(with_model(1, traffic={"rate": 900, "input_tokens": 116})))
    assert main(["plan", "--models", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "bad-plan.yaml")]) == 2
    assert "model 'embed' cannot meet" in capsys.readouterr().err
    assert not (tmp_path / "bad-plan.yaml").exists()


def test_a_measured_gpu_profile_needs_its_models_facts_and_a_usable_ttft() -> None:
    """A hub id with no config at hand: the facts to give are named; a profile whose TTFT misses every goal too."""
    spec = {"gpu": "H100-64", "slo": {"p99_ttft_ms": 2000}, "models": [
        {"name": "opt", "model": "facebook/opt-1.3b", "profile": str(DATA / "bca-opt-1.3b-h100-single.csv"),
         "traffic": {"rate": 10, "input_tokens": 512, "output_tokens": 256}}]}
    with pytest.raises(PlannerError, match=r"model 'opt': cannot size its memory: give weights_gib and "
                                           r"kv_bytes_per_token"):
        make_multi_plan(spec_from_dict(spec))
    spec["models"][0].update(weights_gib=2.45, kv_bytes_per_token=196608)
    with pytest.raises(PackingError, match=r"model 'opt' cannot meet p99 TTFT 2000 ms at any batch cap: its lowest "
                                           r"p99 TTFT with the batch full is 13841 ms"):
        make_multi_plan(spec_from_dict(spec))
    spec["slo"] = {}
    plan = make_multi_plan(spec_from_dict(spec)).plan  # no TTFT goal: sized to keep up with the traffic
    assert plan.replicas and plan.reasoning["multimodel"]["min_headroom"] >= 1


@pytest.mark.parametrize("name, replicas", [("models-cpu.yaml", 2), ("models-h100.yaml", 7)])
def test_the_documented_examples_plan(name: str, replicas: int) -> None:
    """docs/examples/*.yaml plan as docs/multimodel.md shows (paths relative to the file)."""
    from planner.multimodel import load_spec

    plan = make_multi_plan(load_spec(Path(__file__).resolve().parent.parent / "docs" / "examples" / name)).plan
    assert len(plan.replicas) == replicas and plan.reasoning["multimodel"]["min_headroom"] >= 1
