"""One model's speed points for packing: from its measured profile, or estimated by the simulator's step-time model.

A measured point gives tokens/s at batch cap B, turned into requests/s at the traffic's lengths (total tokens/s /
tokens per request: prompt and output tokens cost the same here, which holds where decode dominates and is an
approximation elsewhere), and its p99 TTFT with B requests in flight. `synthetic:NAME` estimates the same from
the roofline in `sim/steptime.py` on the device named by `gpu:`: a decode step of B sequences, each request's
prefill stalling the batch once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import modelinfo
from planner.errors import PlannerError
from planner.memory import GIB, MemoryFacts, cpu_kvcache_space_gib, replica_memory
from planner.multimodel import ModelRequest, MultiSpec
from planner.packing import SpeedPoint
from planner.points import Profile

SYNTHETIC_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_OVERHEAD_GIB = 1.0


@dataclass(frozen=True)
class RawPoint:
    """Speed at one batch cap before memory is known."""

    batch_size: int
    capacity_rps: float
    base_ttft_ms: float
    tpot_ms: float | None
    device_s: float = 0.0  # device-seconds per request besides its share of the step's fixed part (0: not shared)
    step_device_s: float = 0.0  # a step's fixed device time (the weights' read)
    steps: int = 1
    step_s: float = 0.0


def measured_points(profile: Profile, request: ModelRequest) -> list[RawPoint]:
    """A profile's points at this model's traffic; points with preemptions are left out (their KV was short)."""
    tokens = request.traffic.tokens_per_request
    points = []
    for p in profile.points:
        if p.preemptions:
            continue
        ttft = p.ttft_ms.p99 or p.ttft_ms.p50 or p.ttft_ms.mean
        if ttft is None and request.kind == "embed":
            ttft = p.e2e_ms.p99 or p.e2e_ms.mean
        if ttft is None:
            if request.goal.p99_ttft_ms is not None:
                raise PlannerError(f"model {request.name!r}: its profile {profile.context.source!r} has no TTFT at "
                                   f"B={p.batch_size}, so its TTFT goal cannot be checked")
            ttft = 0.0
        capacity = p.total_tok_s / tokens
        busy = (p.gpu.utilization_mean_pct / 100 if p.gpu and p.gpu.utilization_mean_pct is not None else 1.0)
        points.append(RawPoint(p.batch_size, capacity, ttft, p.tpot_ms.p99 or p.tpot_ms.mean,
                               busy / capacity if capacity > 0 else 0.0))
    if not points:
        raise PlannerError(f"model {request.name!r}: every point of its profile had preemptions")
    return points


def synthetic_points(request: ModelRequest, gpu_name: str) -> list[RawPoint]:
    """The step-time model's estimate for `synthetic:NAME` on `gpu_name` (sim/gpus.py)."""
    from sim.gpus import get_gpu
    from sim.model import load_model
    from sim.steptime import StepTimeModel

    try:
        model = load_model(request.profile)
        gpu = get_gpu(gpu_name)
    except (ValueError, FileNotFoundError) as exc:
        raise PlannerError(f"model {request.name!r}: profile {request.profile!r}: {exc}") from None
    steps = StepTimeModel(model, gpu)
    fixed = steps.device_s(0, 0, 0, 0)  # a step over no tokens: reading the weights
    prompt, output = request.traffic.input_tokens, request.traffic.output_tokens
    points = []
    for batch in SYNTHETIC_BATCHES:
        if output == 0:  # an embedding model: B prompts in one pass
            device = steps.device_s(batch * prompt, batch, 0, batch * prompt * prompt / 2)
            pass_s = device + steps.host_s(batch)
            points.append(RawPoint(batch, batch / pass_s, 1000 * 2 * pass_s, None, (device - fixed) / batch, fixed,
                                   1, pass_s))
            continue
        prefill_device = steps.device_s(prompt, 1, 0, prompt * prompt / 2)
        decode_device = steps.decode_s(batch, prompt + output / 2)
        prefill_s, decode_s = prefill_device + steps.host_s(1), decode_device + steps.host_s(batch)
        cycle_s = output * decode_s + batch * prefill_s  # one request's life: its decode steps, every prefill in it
        ttft_s = decode_s + 2 * prefill_s  # wait for the running step, then its prefill behind another arrival's
        tpot_s = decode_s + batch * prefill_s / output
        # The device's time per request: host work overlaps across replicas on one GPU, device work does not;
        # a step's weight read is shared by the requests in it (how many: `SpeedPoint.device_per_request`).
        per_request = prefill_device + output * (decode_device - fixed) / batch
        points.append(RawPoint(batch, batch / cycle_s, 1000 * ttft_s, 1000 * tpot_s, per_request, fixed, output,
                               tpot_s))
    return points


def _kv_per_token(request: ModelRequest, source: str) -> float | None:
    return request.kv_bytes_per_token or modelinfo.kv_bytes_per_token(source)


def _weights(request: ModelRequest, source: str) -> int | None:
    if request.weights_gib is not None:
        return int(request.weights_gib * GIB)
    files = modelinfo.weight_files_bytes(source)
    shape = modelinfo.spec(source)
    return files or (shape.weight_bytes if shape else None)


def replica_bytes(request: ModelRequest, spec: MultiSpec, source: str, batch: int) -> tuple[int, float | None]:
    """One replica's memory slice at `batch` (bytes), and on CPU its VLLM_CPU_KVCACHE_SPACE (GiB)."""
    per_token = _kv_per_token(request, source)
    if spec.device == "cpu":
        kv = batch * request.traffic.tokens_per_request * (per_token or 0)
        space = float(cpu_kvcache_space_gib(int(kv), spec.margin))
        return int((spec.cpu_replica_gib + space) * GIB), space
    weights = _weights(request, source)
    if weights is None or per_token is None:
        missing = " and ".join(n for n, v in (("weights_gib", weights), ("kv_bytes_per_token", per_token)) if v is None)
        raise PlannerError(f"model {request.name!r}: cannot size its memory: give {missing} (its model "
                           f"{request.model!r} has no config.json at hand)")
    if request.overhead_gib is not None:
        overhead = int(request.overhead_gib * GIB)
    else:
        computed = modelinfo.non_kv_bytes(source, batch)
        overhead = computed[0] if computed else int(DEFAULT_OVERHEAD_GIB * GIB)
    facts = MemoryFacts(weights_bytes=weights, overhead_bytes=overhead, margin=spec.margin,
                        kv_bytes_per_token=per_token, tokens_per_request=request.traffic.tokens_per_request)
    return replica_memory(facts, batch).total_bytes, None


def speed_points(request: ModelRequest, spec: MultiSpec, profile: Profile | None, source: str) -> tuple[SpeedPoint, ...]:
    """The model's points, each with its replica's memory slice."""
    raw = measured_points(profile, request) if profile is not None else synthetic_points(request, spec.gpu)
    gpu = spec.device == "gpu"  # CPU replicas are pinned to their own cores: no compute shared
    return tuple(SpeedPoint(p.batch_size, p.capacity_rps, p.base_ttft_ms,
                            replica_bytes(request, spec, source, p.batch_size)[0], p.tpot_ms,
                            p.device_s if gpu else 0.0, p.step_device_s if gpu else 0.0, p.steps, p.step_s)
                 for p in raw if math.isfinite(p.capacity_rps) and p.capacity_rps > 0)
