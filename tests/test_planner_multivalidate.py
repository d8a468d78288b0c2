"""`planner validate` on a multi-model plan: the arrangements it deploys, the mixed traffic, the score."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from deploy.plan import Plan
from planner.client import RequestResult
from planner.errors import PlannerError
from planner.multimodel import spec_from_dict
from planner.multiplan import make_multi_plan
from planner.multivalidate import MultiValidateConfig, MultiValidator, arrangement, drive, score
from tests.conftest import FakeFactory, GatewayFactory
from tests.test_planner_multimodel import GPU_SPEC


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_multi_plan(spec_from_dict(GPU_SPEC)).plan


def test_arrangements_are_the_planners_baselines(plan: Plan) -> None:
    """Equal split and one replica each: the baselines' replicas and caps, the usable memory split evenly by
    model, ports that stay clear of the gateway's."""
    baselines = plan.reasoning["multimodel"]["baselines"]
    for name in ("equal_split", "one_replica_each"):
        layout = arrangement(plan, name)
        assert {m.name for m in layout.models} == {m.name for m in plan.models}
        for entry in layout.models:
            replicas = layout.replicas_of(entry.name)
            wanted = baselines[name]["models"][entry.name]
            assert len(replicas) == wanted["replicas"]
            assert {r.max_num_seqs for r in replicas} == {wanted["batch_size"]}
            assert sum(r.gpu_memory_utilization or 0 for r in replicas) == pytest.approx(0.3, abs=0.001)
        assert plan.gateway.port not in {r.port for r in layout.replicas}
    assert arrangement(plan, "packed").replicas == plan.replicas


def test_score_counts_goodput_within_each_models_goal(plan: Plan) -> None:
    """Goodput: requests within their model's TTFT goal per second; failures count as missed."""
    ok = RequestResult(0.0, 1.0, ttft_s=0.05)
    slow = RequestResult(0.0, 1.0, ttft_s=0.9)
    failed = RequestResult(0.0, 1.0, error="HTTP 503")
    row = score(plan.models, {"chat": [ok, ok, slow, failed], "code": [ok], "embed": [slow]}, duration_s=2.0)
    assert row["models"]["chat"] == {"requests": 4, "failed": 1, "p99_ttft_ms": 900.0, "within_goal": 0.5}
    assert row["models"]["embed"]["within_goal"] == 0.0  # 900 ms against 100 ms
    assert row["goodput_rps"] == 1.5 and row["within_goal"] == pytest.approx(3 / 6)


def test_a_one_model_plan_is_not_validated_here() -> None:
    one = Plan("m", make_multi_plan(spec_from_dict(GPU_SPEC)).plan.replicas[:1])
    with pytest.raises(PlannerError, match="not a multi-model plan"):
        MultiValidator(one, MultiValidateConfig(), deployer=None)  # type: ignore[arg-type]


async def test_mixed_traffic_reaches_each_models_replicas(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                                          plan: Plan) -> None:
    """Each model's Poisson arrivals go to its own endpoint and model name through the gateway."""
    fakes = {name: await fake_replica(model=name) for name in ("chat", "code", "embed")}
    gw = await gateway_for([f.url for f in fakes.values()])
    config = MultiValidateConfig(duration_s=1.0, seed=1)
    results = await drive(gw.url, plan.models, config)
    for entry in plan.models:
        rows = results[entry.name]
        assert rows and all(r.ok for r in rows)
        assert len(fakes[entry.name].stats.bodies) == len(rows)
    assert all("input" in body for body in fakes["embed"].stats.bodies)
    assert all(body["stream"] for body in fakes["chat"].stats.bodies)


def test_the_validator_deploys_each_arrangement_and_writes_the_comparison(plan: Plan,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stand-in deployer and traffic: every arrangement deployed once; the best by goodput is named."""
    deployed: list[str] = []

    class Deployer:
        @contextlib.contextmanager
        def deploy(self, layout: Plan, label: str) -> Iterator[str]:
            deployed.append(label)
            yield "http://127.0.0.1:9"

    async def fake_drive(url: str, models: object, config: MultiValidateConfig,
                         builders: object = None) -> dict[str, list[RequestResult]]:
        fast = RequestResult(0.0, 1.0, ttft_s=0.01 if deployed[-1] == "packed" else 10.0)
        return {m.name: [fast] for m in plan.models}

    monkeypatch.setattr("planner.multivalidate.drive", fake_drive)
    validated = MultiValidator(plan, MultiValidateConfig(duration_s=1), Deployer(), out=lambda line: None).run()
    assert deployed == ["packed", "equal_split", "one_replica_each"]
    assert validated.validation["best"] == "packed"
    assert validated.validation["arrangements"]["equal_split"]["within_goal"] == 0.0
