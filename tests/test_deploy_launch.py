"""From flags or a plan to replica launches and the gateway config: GPU and CPU, CPU pinning, plan files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy.cli import _parser, build_plan, build_up_config
from deploy.hardware import Gpu, Hardware, cpu_list, split_cpus
from deploy.launch import PlanOptions, default_plan, fit_to_hardware, gateway_config, launches, local_tokenizers, \
    with_models
from deploy.models import TINY_MODEL_ARGS, ModelError, ResolvedModel, resolve
from deploy.plan import Admission, GatewaySpec, Plan, PlanError, ReplicaSpec, dump, load
from deploy.process import vllm_argv
from gateway.config import from_mapping

GPU = Hardware(gpus=(Gpu(0, "NVIDIA H100", 80 * 2**30),), cpus=tuple(range(16)))
CPU = Hardware(gpus=(), cpus=(0, 1))


def test_split_cpus_even_and_uneven() -> None:
    """Cores are split into disjoint contiguous slices; leftovers go to the first replicas."""
    assert split_cpus((0, 1), 2) == [(0,), (1,)]
    assert split_cpus(tuple(range(7)), 3) == [(0, 1, 2), (3, 4), (5, 6)]
    assert split_cpus((0,), 2) == [(0,), (0,)]


def test_cpu_list_collapses_ranges() -> None:
    """CPU ids become vLLM's VLLM_CPU_OMP_THREADS_BIND syntax."""
    assert cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert cpu_list((3,)) == "3"


def test_default_gpu_plan_splits_memory_and_caps_batches() -> None:
    """Without a plan on a GPU: 0.9/N of the memory each, a batch cap, the gateway capped at the same."""
    plan = default_plan(PlanOptions(model="facebook/opt-125m", replicas=3, port=9000), GPU)
    assert [r.port for r in plan.replicas] == [9001, 9002, 9003]
    assert all(r.gpu_memory_utilization == 0.3 and r.cpu_kvcache_space_gib is None for r in plan.replicas)
    assert all(r.max_num_seqs == 128 and r.admission.max_requests == 128 for r in plan.replicas)
    assert plan.gateway.port == 9000 and plan.gateway.queue_size > 0
    argv = " ".join(vllm_argv(plan.replicas[0]))
    assert "--gpu-memory-utilization 0.3" in argv and "--max-num-seqs 128" in argv


def test_default_cpu_plan_pins_cores_and_sizes_the_kv_cache() -> None:
    """Without a GPU: a CPU KV cache per replica and each replica's threads on its own core."""
    plan = fit_to_hardware(default_plan(PlanOptions(replicas=2, port=9000), CPU), CPU)
    assert all(r.cpu_kvcache_space_gib == 1.0 and r.gpu_memory_utilization is None for r in plan.replicas)
    runs = launches(plan, CPU)
    assert [launch.env["VLLM_CPU_OMP_THREADS_BIND"] for launch in runs] == ["0", "1"]
    assert [launch.cpus for launch in runs] == [(0,), (1,)]  # the whole replica confined, not only its threads
    argv = vllm_argv(runs[0].spec)
    assert "--gpu-memory-utilization" not in argv and "--max-num-seqs" in argv


def test_gpu_launches_have_no_cpu_pinning() -> None:
    """On a GPU no CPU binding is set."""
    plan = fit_to_hardware(default_plan(PlanOptions(replicas=2), GPU), GPU)
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in launch.env and launch.cpus == () for launch in launches(plan, GPU))


def test_fit_to_hardware_gives_a_gpu_share_when_the_plan_names_none() -> None:
    """A plan replica with no memory setting gets 0.9/N on a GPU (vLLM's 0.9 each would not fit)."""
    plan = Plan(model="m", replicas=(ReplicaSpec("a", "m", 8001), ReplicaSpec("b", "m", 8002)))
    fitted = fit_to_hardware(plan, GPU)
    assert [r.gpu_memory_utilization for r in fitted.replicas] == [0.45, 0.45]
    kv = Plan(model="m", replicas=(ReplicaSpec("a", "m", 8001, kv_cache_memory_bytes=10**9),))
    assert fit_to_hardware(kv, GPU).replicas[0].gpu_memory_utilization is None


def test_tiny_model_replicas_get_its_path_name_and_cpu_safe_flags() -> None:
    """The tiny model stands in under its own served name, eager, in float32, with a context length."""
    plan = default_plan(PlanOptions(model="facebook/opt-125m"), CPU)
    tiny = ResolvedModel("facebook/opt-125m", "/cache/tiny-opt", "tiny-opt", offline=True, fallback_reason="offline",
                         flags=TINY_MODEL_ARGS, default_max_model_len=2048)
    replaced = with_models(plan, {"facebook/opt-125m": tiny})
    spec = replaced.replicas[0]
    assert spec.model == "/cache/tiny-opt" and spec.served_model_name == "tiny-opt" and spec.max_model_len == 2048
    assert "--enforce-eager" in spec.extra_args and "--dtype" in spec.extra_args
    assert local_tokenizers(replaced) == {"tiny-opt": "/cache/tiny-opt"}
    user = with_models(default_plan(PlanOptions(model="m", extra_args=("--dtype=bfloat16",)), CPU), {"m": tiny})
    assert user.replicas[0].extra_args == ("--dtype=bfloat16", "--enforce-eager")


def test_synthetic_model_gets_dummy_weights_and_device_flags(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """synthetic:NAME resolves to a local directory, served as synthetic-NAME with --load-format dummy; on the CPU
    build also float32 and eager mode, on a GPU not (its speed must be the real model's); a context length."""
    monkeypatch.setenv("SMALLSERVE_CACHE", str(tmp_path))
    model = resolve("synthetic:qwen3-0.6b", hub=lambda m, t: pytest.fail("no hub for synthetic models"))
    assert model.source.startswith(str(tmp_path)) and model.served_name == "synthetic-qwen3-0.6b"
    for hardware, gpu in ((CPU, False), (GPU, True)):
        plan = with_models(default_plan(PlanOptions(model="synthetic:qwen3-0.6b"), hardware),
                           {"synthetic:qwen3-0.6b": model}, gpu=gpu)
        spec = plan.replicas[0]
        assert spec.model == model.source and spec.served_model_name == "synthetic-qwen3-0.6b"
        assert spec.max_model_len == 4096 and "--load-format" in spec.extra_args
        assert ("--enforce-eager" in spec.extra_args) is not gpu and ("--dtype" in spec.extra_args) is not gpu
    given = default_plan(PlanOptions(model="synthetic:qwen3-0.6b", max_model_len=512,
                                     extra_args=("--load-format=dummy",)), CPU)
    spec = with_models(given, {"synthetic:qwen3-0.6b": model}).replicas[0]
    assert spec.max_model_len == 512 and spec.extra_args.count("--load-format=dummy") == 1
    assert "--load-format" not in spec.extra_args
    with pytest.raises(ModelError, match="no synthetic model 'synthetic:gpt-5'.*opt-1.3b"):
        resolve("synthetic:gpt-5")


def test_hub_model_keeps_its_name() -> None:
    """A model loadable from the hub is passed through unchanged."""
    plan = default_plan(PlanOptions(model="facebook/opt-125m"), GPU)
    same = with_models(plan, {"facebook/opt-125m": ResolvedModel("facebook/opt-125m", "facebook/opt-125m", None)})
    assert same.replicas[0].model == "facebook/opt-125m" and same.replicas[0].served_model_name is None
    assert "--served-model-name" not in vllm_argv(same.replicas[0])


def test_gateway_config_is_valid_for_the_gateway() -> None:
    """The YAML we write for the gateway loads with the gateway's own config loader, caps included."""
    replicas = (ReplicaSpec("a", "m", 8001, admission=Admission(max_requests=64, max_outstanding_tokens=50000)),
                ReplicaSpec("b", "m", 8002, admission=Admission(max_requests=64)))
    plan = Plan(model="m", replicas=replicas, gateway=GatewaySpec(port=8000, policy="round_robin", queue_size=100,
                                                                  queue_wait_s=5))
    data = yaml.safe_load(yaml.safe_dump(gateway_config(plan, tokenizers={"m": "/models/m"})))
    config = from_mapping(data)
    assert [r.url for r in config.replicas] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert config.replicas[0].max_outstanding_tokens == 50000 and config.replicas[1].max_outstanding_tokens is None
    assert config.replicas[1].max_requests == 64
    assert (config.port, config.policy, config.queue.max_size, config.queue.max_wait_s) == (8000, "round_robin", 100, 5)
    assert config.tokenizer_map() == {"m": "/models/m"}


def test_plan_round_trips_through_a_file(tmp_path: Path) -> None:
    """dump then load gives the same plan, the served name and extra args included."""
    plan = Plan(model="m", replicas=(ReplicaSpec("r0", "m", 8001, max_num_seqs=8, extra_args=("--seed", "1"),
                                                 served_model_name="mm"),))
    dump(plan, tmp_path / "plan.yaml")
    assert load(tmp_path / "plan.yaml") == plan


def test_plan_file_with_port_override(tmp_path: Path) -> None:
    """`deploy up --plan F --port P -- ARGS` keeps the plan's replicas, moves the gateway, appends the args."""
    plan = Plan(model="m", replicas=(ReplicaSpec("r0", "m", 8001, gpu_memory_utilization=0.4),))
    dump(plan, tmp_path / "plan.yaml")
    args = _parser().parse_args(["up", "--plan", str(tmp_path / "plan.yaml"), "--port", "9100", "--", "--seed", "3"])
    built = build_plan(args, GPU)
    assert built.gateway.port == 9100 and built.replicas[0].gpu_memory_utilization == 0.4
    assert built.replicas[0].extra_args == ("--seed", "3")
    assert built.gateway.workers == 1 and gateway_config(built)["workers"] == 1


def test_gateway_workers_come_from_the_plan_or_the_flag(tmp_path: Path) -> None:
    """The plan's worker count reaches the gateway's config; `--gateway-workers` overrides it."""
    plan = Plan(model="m", replicas=(ReplicaSpec("r0", "m", 8001),), gateway=GatewaySpec(workers=3))
    dump(plan, tmp_path / "plan.yaml")
    built = build_plan(_parser().parse_args(["up", "--plan", str(tmp_path / "plan.yaml")]), GPU)
    assert from_mapping(gateway_config(built)).workers == 3
    flagged = build_plan(_parser().parse_args(["up", "--plan", str(tmp_path / "plan.yaml"),
                                               "--gateway-workers", "2"]), GPU)
    assert flagged.gateway.workers == 2
    assert build_plan(_parser().parse_args(["up", "--gateway-workers", "4"]), GPU).gateway.workers == 4
    with pytest.raises(PlanError, match="workers"):
        build_plan(_parser().parse_args(["up", "--gateway-workers", "0"]), GPU)


def test_plan_file_with_sizing_flags_is_refused(tmp_path: Path) -> None:
    """Flags the plan decides (--replicas, --model, ...) cannot be combined with --plan."""
    dump(Plan(model="m", replicas=(ReplicaSpec("r0", "m", 8001),)), tmp_path / "plan.yaml")
    args = _parser().parse_args(["up", "--plan", str(tmp_path / "plan.yaml"), "--replicas", "3"])
    with pytest.raises(PlanError, match="--replicas"):
        build_plan(args, GPU)


def test_port_clash_in_plan_is_refused(tmp_path: Path) -> None:
    """A gateway port equal to a replica's is an error naming the ports."""
    dump(Plan(model="m", replicas=(ReplicaSpec("r0", "m", 8001),)), tmp_path / "plan.yaml")
    args = _parser().parse_args(["up", "--plan", str(tmp_path / "plan.yaml"), "--port", "8001"])
    with pytest.raises(PlanError, match="collide"):
        build_plan(args, GPU)


def test_bad_replica_count_is_refused() -> None:
    """--replicas 0 is an error naming the value."""
    with pytest.raises(ValueError, match="--replicas"):
        PlanOptions(replicas=0)


def test_replica_nice_defaults_to_below_the_gateway_and_out_of_range_is_refused() -> None:
    """Replicas run 10 below normal priority unless told; --replica-nice past 0-19 is an error naming the flag."""
    assert _parser().parse_args(["up"]).replica_nice == 10
    with pytest.raises(ValueError, match="--replica-nice"):
        build_up_config(_parser().parse_args(["up", "--replica-nice", "20"]))
