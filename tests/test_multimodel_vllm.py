"""Two different models on one machine with REAL vLLM (CPU): a generative and an embedding model, packed by a plan.

`planner plan --models` packs tiny-opt (deploy/tinymodel.py) and tiny-embed (deploy/tinyembed.py, a BERT served
by vLLM's pooling runner) from their measured CPU profiles (planner/data/), `deploy up --plan` starts both, one
after the other, and the gateway routes each request by its `model`: the official openai client's completions
and embeddings both come back, each from its own model's replica.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from openai import OpenAI

from deploy.plan import Plan, load
from deploy.ports import free_ports
from deploy.process import ManagedProcess
from planner.cli import main

pytestmark = pytest.mark.vllm

STARTUP_S = "300"
DATA = Path(__file__).resolve().parent.parent / "planner" / "data"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two models' plan, from their profiles and traffic (a CPU plan: 12 GiB of RAM, 2 cores)."""
    directory = tmp_path_factory.mktemp("multimodel")
    base = free_ports(3)
    spec = {"device": "cpu", "memory_gib": 12, "cpus": 2, "gateway_port": base, "base_port": base + 1,
            "slo": {"p99_ttft_ms": 1000},
            "models": [
                {"name": "tiny-opt", "model": "tiny", "profile": str(DATA / "tiny-opt-cpu.csv"),
                 "traffic": {"rate": 10, "input_tokens": 64, "output_tokens": 16}},
                {"name": "tiny-embed", "model": "tiny-embed", "kind": "embed",
                 "profile": str(DATA / "tiny-embed-cpu.csv"), "traffic": {"rate": 20, "input_tokens": 116},
                 "slo": {"p99_ttft_ms": 300}}]}
    (directory / "models.yaml").write_text(yaml.safe_dump(spec))
    path = directory / "plan.yaml"
    assert main(["plan", "--models", str(directory / "models.yaml"), "--out", str(path)]) == 0
    return path


def test_plan_packs_one_replica_of_each_model(plan_file: Path) -> None:
    """Two cores, two models: one replica each, the embedder on vLLM's pooling runner, each with its own policy."""
    plan = load(plan_file)
    assert [(r.served_model_name, r.max_num_seqs) for r in plan.replicas] == [("tiny-opt", 32), ("tiny-embed", 4)]
    assert plan.replicas[1].extra_args[:2] == ("--runner", "pooling")
    assert {m.name: (m.kind, m.policy) for m in plan.models} == {
        "tiny-opt": ("generate", "prefix_affinity"), "tiny-embed": ("embed", "least_outstanding_tokens")}
    assert plan.reasoning["multimodel"]["min_headroom"] >= 1


@pytest.fixture(scope="module")
def gateway_url(plan_file: Path) -> Iterator[str]:
    """`deploy up --plan plan.yaml` as planned, until the gateway's /ready answers (both replicas are up by then:
    deploy starts the gateway after the last replica is healthy)."""
    plan: Plan = load(plan_file)
    url = f"http://127.0.0.1:{plan.gateway.port}"
    argv = [sys.executable, "-m", "deploy.cli", "up", "--plan", str(plan_file), "--run-dir",
            str(plan_file.parent / "run"), "--startup-timeout", STARTUP_S, "--host", "127.0.0.1"]
    with ManagedProcess("deploy up", argv, plan_file.parent / "deploy.log", f"{url}/ready",
                        startup_timeout_s=2 * float(STARTUP_S) + 60, stop_grace_s=90):
        yield url


def test_each_model_is_served_by_its_own_replica(gateway_url: str, plan_file: Path) -> None:
    """Completions go to tiny-opt's replica, embeddings to tiny-embed's; an unknown model is a 404."""
    plan = load(plan_file)
    urls = {r.served_model_name: f"http://127.0.0.1:{r.port}" for r in plan.replicas}
    with OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0, timeout=60) as client:
        assert {m.id for m in client.models.list().data} == {"tiny-opt", "tiny-embed"}
        raw = client.completions.with_raw_response.create(model="tiny-opt", prompt="Hello there", max_tokens=8,
                                                          extra_body={"ignore_eos": True})
        done = raw.parse()
        assert done.usage is not None and done.usage.completion_tokens == 8
        assert raw.headers["x-gateway-replica"] == urls["tiny-opt"]
        raw_embed = client.embeddings.with_raw_response.create(model="tiny-embed",
                                                               input=["the quick brown fox", "hello"])
        vectors = raw_embed.parse()
        assert [len(d.embedding) for d in vectors.data] == [256, 256]
        assert raw_embed.headers["x-gateway-replica"] == urls["tiny-embed"]
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="no-such-model", input="x")
    gateway = yaml.safe_load((plan_file.parent / "run" / "gateway.yaml").read_text())
    assert gateway["models"]["tiny-embed"]["policy"] == "least_outstanding_tokens"
