"""`planner plan` end to end in-process: reference CSV -> plan.yaml that deploy.plan loads; CPU plans; errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.plan import gateway_workers, load
from planner.cli import main
from planner.memory import GIB
from planner.planning import split_vllm_args
from planner.points import KvPool, ProfileContext, ProfilePoint, Workload
from planner.sources import write_point

REFERENCE = Path(__file__).resolve().parent.parent / "planner" / "data" / "bca-opt-1.3b-h100-single.csv"
GPU_FLAGS = ["--gpu-memory-gib", "64", "--weights-gib", "2.45", "--kv-bytes-per-token", "196608",
             "--model", "facebook/opt-1.3b"]


def test_reference_csv_plans_two_replicas_at_0_45_like_the_paper(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """OPT-1.3B, 400 tokens/request, 64 GiB: B*=256, two 24.4 GiB slices, 0.9/2 = 0.45 each."""
    out = tmp_path / "plan.yaml"
    code = main(["plan", "--profile", str(REFERENCE), "--out", str(out), "--tokens-per-request", "400", *GPU_FLAGS])
    assert code == 0
    plan = load(out)
    assert [r.port for r in plan.replicas] == [8001, 8002]
    assert all(r.max_num_seqs == 256 and r.gpu_memory_utilization == 0.45 for r in plan.replicas)
    assert all(r.admission.max_requests == 256 and r.model == "facebook/opt-1.3b" for r in plan.replicas)
    assert plan.gateway.port == 8000 and plan.gateway.queue_size == 2048
    reasoning = plan.reasoning
    assert reasoning["batch"]["b_star"] == 256 and reasoning["bca"]["batch_size"] == 128
    assert "BCA picks B=128" in reasoning["bca"]["explanation"]
    memory = reasoning["memory"]
    assert memory["kv_bytes"] == 256 * 25 * 16 * 196608  # 400 tokens -> 25 blocks of 16
    assert memory["sources"]["kv_bytes_per_token"] == "--kv-bytes-per-token"
    assert memory["sources"]["overhead"].startswith("default 1 GiB")
    assert reasoning["layout"]["fit"] == 2
    assert "B* = 256" in capsys.readouterr().out
    sizing = reasoning["gateway_workers"]  # 2 x ~10,800 tok/s x the workload's output share, 21 us/event
    assert plan.gateway.workers == sizing["workers"] == gateway_workers(sizing["expected_output_tok_s"]) >= 1
    assert 0 < sizing["expected_output_tok_s"] <= 2 * reasoning["batch"]["best_tok_s"]


def test_gateway_workers_follow_the_expected_token_rate() -> None:
    """One event per output token at 21 us, half a core per worker: 23,810 events/s per worker."""
    assert gateway_workers(0) == 1 and gateway_workers(23_800) == 1 and gateway_workers(23_900) == 2
    assert gateway_workers(65_000) == 3  # four OPT-125M replicas on an H100 (the flagship case)


def test_full_length_requests_leave_room_for_one_replica(tmp_path: Path) -> None:
    """512 in + 256 out at B*=256 needs 36 GiB of KV: only one slice fits in 57.6 GiB."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", str(REFERENCE), "--out", str(out), "--tokens-per-request", "768",
                 *GPU_FLAGS]) == 0
    plan = load(out)
    assert len(plan.replicas) == 1 and plan.replicas[0].gpu_memory_utilization == 0.9


def test_kv_cache_bytes_mode_writes_bytes_not_a_fraction(tmp_path: Path) -> None:
    """--kv-cache-bytes gives each replica its share minus weights and overhead as kv_cache_memory_bytes."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", str(REFERENCE), "--out", str(out), "--tokens-per-request", "400",
                 "--kv-cache-bytes", "--overhead-gib", "1", *GPU_FLAGS]) == 0
    replica = load(out).replicas[0]
    assert replica.gpu_memory_utilization is None
    assert replica.kv_cache_memory_bytes == int(0.45 * 64 * GIB) - int(2.45 * GIB) - GIB


def test_slo_that_nothing_meets_exits_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A p99 ITL SLO below every measurement is a clear message and exit code 2, no traceback."""
    code = main(["plan", "--profile", str(REFERENCE), "--out", str(tmp_path / "p.yaml"), "--slo-p99-itl-ms", "1",
                 "--tokens-per-request", "400", *GPU_FLAGS])
    err = capsys.readouterr().err
    assert code == 2
    assert "p99 ITL <= 1 ms: the lowest measured is 4.5 ms at B=1" in err and "Traceback" not in err
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize(("flags", "message"), [
    ([], "says nothing about the device: give --gpu-memory-gib"),
    (["--gpu-memory-gib", "64"], "names no model: give --model"),
    (["--gpu-memory-gib", "64", "--model", "m", "--weights-gib", "2"], "needs --kv-bytes-per-token and "
                                                                       "--tokens-per-request"),
    (["--epsilon", "1.5"], "epsilon must be in [0, 1), got 1.5"),
    (["--gpu-memory-gib", "-3"], "--gpu-memory-gib must be a positive number, got -3.0"),
])
def test_missing_facts_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                 message: str) -> None:
    """Each missing or bad input is named in the message."""
    assert main(["plan", "--profile", str(REFERENCE), "--out", str(tmp_path / "p.yaml"), *flags]) == 2
    assert message in capsys.readouterr().err


def cpu_profile(directory: Path) -> Path:
    """A crafted CPU profile directory: measured KV pool and peak usage, no GPU facts."""
    context = ProfileContext(model="/models/tiny", device="cpu", workload=Workload("fixed", 32, 16),
                             vllm_args=("--max-model-len", "512", "--dtype", "float32"), cpu_kvcache_space_gib=1)
    pool = KvPool(num_blocks=4096, block_size=128, bytes=GIB)
    for batch, tok_s, peak in ((2, 300.0, 0.01), (4, 550.0, 0.02), (8, 700.0, 0.03), (16, 720.0, 0.05)):
        write_point(directory, context, ProfilePoint(batch_size=batch, total_tok_s=tok_s, peak_kv_usage=peak,
                                                     kv_pool=pool, preemptions=0))
    return directory


def test_cpu_profile_gives_a_cpu_plan(tmp_path: Path) -> None:
    """No GPU facts: cpu_kvcache_space_gib per replica, 2 replicas by default, the profile's vLLM args kept."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", str(cpu_profile(tmp_path / "prof")), "--out", str(out),
                 "--base-port", "9101", "--gateway-port", "9100"]) == 0
    plan = load(out)
    assert len(plan.replicas) == 2 and plan.model == "/models/tiny"
    replica = plan.replicas[0]
    assert (replica.max_num_seqs, replica.cpu_kvcache_space_gib, replica.gpu_memory_utilization) == (8, 1.0, None)
    assert replica.max_model_len == 512 and replica.extra_args == ("--dtype", "float32")
    memory = plan.reasoning["memory"]
    assert memory["kv_source"].startswith("measured")
    assert memory["kv_bytes"] == 123 * 128 * 2048  # ceil(0.03 x 4096) blocks x 128 tokens x 2 KiB/token
    assert plan.reasoning["device"] == "cpu" and plan.gateway.port == 9100


def test_cpu_replica_count_from_flag(tmp_path: Path) -> None:
    """--replicas sets the CPU replica count."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", str(cpu_profile(tmp_path / "prof")), "--out", str(out),
                 "--replicas", "3"]) == 0
    assert [r.name for r in load(out).replicas] == ["r0", "r1", "r2"]


def test_colliding_ports_are_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A gateway port inside the replicas' port range is reported, not a traceback."""
    code = main(["plan", "--profile", str(cpu_profile(tmp_path / "prof")), "--out", str(tmp_path / "p.yaml"),
                 "--base-port", "9000", "--gateway-port", "9001"])
    assert code == 2 and "ports collide" in capsys.readouterr().err


def test_split_vllm_args_drops_what_the_plan_sets() -> None:
    """--max-model-len goes to its own field; flags the plan sets are dropped in both spellings."""
    args = ("--max-num-seqs", "8", "--max-model-len=1024", "--dtype", "half", "--port", "1", "--enforce-eager")
    assert split_vllm_args(args) == (1024, ("--dtype", "half", "--enforce-eager"))


def test_plateau_at_the_largest_profiled_batch_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """When the best B is the largest profiled, the plan says the plateau may lie further out."""
    profile = tmp_path / "prof.csv"
    profile.write_text("batch_size,total_tok_s\n8,100\n16,190\n32,400\n")
    assert main(["plan", "--profile", str(profile), "--out", str(tmp_path / "p.yaml"), "--device", "cpu",
                 "--model", "m", "--kv-bytes-per-token", "1000", "--tokens-per-request", "64"]) == 0
    assert "warning: the best throughput is at the largest batch size profiled (B=32)" in capsys.readouterr().out
    assert load(tmp_path / "p.yaml").reasoning["warnings"]


def test_gpu_profile_plans_from_its_own_measurements(tmp_path: Path) -> None:
    """A GPU profile needs no flags: device memory, weights, KV pool, peak usage and overhead were measured."""
    from planner.points import GpuSummary

    context = ProfileContext(model="/models/opt-1.3b", device="gpu", workload=Workload("fixed", 512, 256),
                             weights_bytes=int(2.5 * GIB), kv_bytes_per_token=196608.0, gpu_name="H100",
                             gpu_memory_total_bytes=80 * GIB)
    pool = KvPool(num_blocks=20000, block_size=16)  # on a GPU vLLM reports blocks, not bytes
    pool_bytes = 20000 * 16 * 196608
    gpu = GpuSummary(name="H100", memory_total_bytes=80 * GIB, samples=50, memory_used_before_bytes=GIB,
                     memory_used_max_bytes=GIB + int(2.5 * GIB) + pool_bytes + int(1.5 * GIB))
    for batch, tok_s, peak in ((64, 5000.0, 0.18), (128, 8000.0, 0.35), (256, 8300.0, 0.7)):
        write_point(tmp_path / "prof", context, ProfilePoint(batch_size=batch, total_tok_s=tok_s, preemptions=0,
                                                             peak_kv_usage=peak, kv_pool=pool, gpu=gpu))
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", str(tmp_path / "prof"), "--out", str(out)]) == 0
    plan = load(out)
    memory = plan.reasoning["memory"]
    assert plan.reasoning["batch"]["b_star"] == 128 and plan.reasoning["device"] == "gpu"
    assert memory["kv_bytes"] == 7000 * 16 * 196608  # 35% of 20000 blocks > 128 x 48 blocks computed
    assert memory["kv_source"].startswith("measured")
    assert memory["overhead_bytes"] == int(1.5 * GIB) and memory["sources"]["overhead"].startswith("measured")
    assert memory["sources"]["weights"].startswith("the profile")
    assert plan.reasoning["layout"]["device_source"] == "measured: NVML"
    assert [r.gpu_memory_utilization for r in plan.replicas] == [0.45, 0.45]  # two 27 GiB slices in 72 GiB
