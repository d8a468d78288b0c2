"""From a profile to a deployment plan (`deploy.plan.Plan`): B*, memory per replica, replica count, and why.

Pure apart from reading a local model directory for facts the profile lacks. Every number in the plan's
`reasoning` says where it came from: measured (by `planner profile`), a flag, the model's config, or a default.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy.plan import (LORA_RANKS, US_PER_EVENT, WORKER_BUSY, Admission, GatewaySpec, Plan, PlanError, ReplicaSpec, dump,
                         gateway_workers)
from gateway.config import DEFAULT_POLICY
from planner import modelinfo
from planner.choice import BcaConfig, ChoiceConfig, Choice, bca_choice, choose_batch, explain_difference
from planner.errors import MemoryPlanError, PlannerError
from planner.memory import (GIB, MemoryFacts, ReplicaMemory, cpu_kvcache_space_gib, gib, gpu_layout,
                            measured_kv_bytes, replica_memory)
from planner.points import Profile, ProfilePoint
from planner.speed import gateway_speed

DEFAULT_GPU_OVERHEAD_GIB = 1.0
DEFAULT_CPU_REPLICAS = 2
# Flags the plan sets itself, so the profile's copies must not reach extra_args twice.
_PLAN_FLAGS_WITH_VALUE = ("--max-num-seqs", "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--port",
                          "--host", "--model", "--max-model-len", "--served-model-name")


@dataclass(frozen=True)
class PlanConfig:
    """Everything `planner plan` takes besides the profile."""

    choice: ChoiceConfig = field(default_factory=ChoiceConfig)
    bca: BcaConfig = field(default_factory=BcaConfig)
    model: str | None = None
    device: str = "auto"  # auto | gpu | cpu
    gpu_memory_gib: float | None = None
    usable_fraction: float = 0.9
    weights_gib: float | None = None
    kv_bytes_per_token: float | None = None
    tokens_per_request: int | None = None
    block_size: int | None = None
    overhead_gib: float | None = None
    margin: float = 0.10
    replicas: int | None = None
    max_replicas: int | None = None
    kv_cache_bytes_mode: bool = False  # write kv_cache_memory_bytes instead of gpu_memory_utilization
    base_port: int = 8001
    gateway_port: int = 8000
    policy: str = DEFAULT_POLICY
    queue_size: int | None = None
    queue_wait_s: float = 30.0
    max_loras: int | None = None  # LoRA on: adapter slots per replica (vLLM --max-loras), counted in memory
    max_lora_rank: int = 16  # vLLM's default
    lora_gib: float | None = None  # one replica's LoRA slots, when the model's config is not at hand

    def __post_init__(self) -> None:
        if self.max_loras is not None and self.max_loras < 1:
            raise PlannerError(f"--max-loras must be a positive integer, got {self.max_loras!r}")
        if self.max_lora_rank not in LORA_RANKS:
            raise PlannerError(f"--max-lora-rank must be one of {LORA_RANKS}, got {self.max_lora_rank!r}")
        if self.lora_gib is not None and (not math.isfinite(self.lora_gib) or self.lora_gib < 0):
            raise PlannerError(f"--lora-gib must be a non-negative number, got {self.lora_gib!r}")
        if self.device not in ("auto", "gpu", "cpu"):
            raise PlannerError(f"device must be auto, gpu or cpu, got {self.device!r}")
        for name in ("gpu_memory_gib", "weights_gib", "kv_bytes_per_token", "overhead_gib"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0 or
                                      (value == 0 and name in ("gpu_memory_gib", "kv_bytes_per_token"))):
                raise PlannerError(f"--{name.replace('_', '-')} must be a positive number, got {value!r}")
        for name in ("tokens_per_request", "block_size", "replicas", "max_replicas", "queue_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlannerError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not 0 < self.usable_fraction <= 1:
            raise PlannerError(f"--usable-fraction must be in (0, 1], got {self.usable_fraction!r}")
        if not 0 <= self.margin < 1:
            raise PlannerError(f"--margin must be in [0, 1), got {self.margin!r}")


def split_vllm_args(args: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
    """(max_model_len, the rest): the profile's vLLM arguments minus the ones the plan sets itself."""
    max_model_len, rest, skip = None, [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        name, eq, value = arg.partition("=")
        if name in _PLAN_FLAGS_WITH_VALUE:
            if not eq:
                value, skip = (args[i + 1] if i + 1 < len(args) else ""), True
            if name == "--max-model-len" and value.isdigit():
                max_model_len = int(value)
            continue
        rest.append(arg)
    return max_model_len, tuple(rest)


def _device(profile: Profile, config: PlanConfig) -> str:
    if config.device != "auto":
        return config.device
    if config.gpu_memory_gib is not None or profile.context.gpu_memory_total_bytes:
        return "gpu"
    if profile.context.device == "cpu":
        return "cpu"
    raise PlannerError(f"the profile {profile.context.source!r} says nothing about the device: give "
                       "--gpu-memory-gib (a GPU plan) or --device cpu (a CPU plan)")


@dataclass(frozen=True)
class _Fact:
    value: float | None
    source: str


def _first(*candidates: tuple[float | None, str]) -> _Fact:
    for value, source in candidates:
        if value is not None:
            return _Fact(value, source)
    return _Fact(None, "unknown")


def _model(profile: Profile, config: PlanConfig) -> str:
    model = config.model or profile.context.model
    if not model:
        raise PlannerError(f"the profile {profile.context.source!r} names no model: give --model")
    return model


def _memory_facts(profile: Profile, point: ProfilePoint, config: PlanConfig, device: str,
                  model: str) -> tuple[MemoryFacts, dict[str, str]]:
    ctx, pool = profile.context, point.kv_pool
    per_token = _first((config.kv_bytes_per_token, "--kv-bytes-per-token"),
                       (pool.bytes_per_token if pool else None, "measured: the KV pool's bytes / tokens"),
                       (ctx.kv_bytes_per_token, "the profile (model config)"),
                       (modelinfo.kv_bytes_per_token(model), "the model's config.json"))
    shape = modelinfo.spec(model)
    weights = _first((config.weights_gib * GIB if config.weights_gib is not None else None, "--weights-gib"),
                     (ctx.weights_bytes, "the profile (the model's weight files, or its parameters x 2 bytes)"),
                     (modelinfo.weight_files_bytes(model), "the model's weight files on disk"),
                     (shape.weight_bytes if shape else None,
                      f"the model's config.json: {shape.params:,} parameters x 2 bytes" if shape else ""))
    if weights.value is None:
        if device == "gpu":
            raise MemoryPlanError(f"the weights' size of {model!r} is unknown: give --weights-gib")
        weights = _Fact(0, "not needed on CPU: VLLM_CPU_KVCACHE_SPACE sizes only the KV pool")
    tokens = _first((config.tokens_per_request, "--tokens-per-request"),
                    (ctx.workload.tokens_per_request, f"the profile's {ctx.workload.kind} workload"))
    block = _first((config.block_size, "--block-size"), (pool.block_size if pool else None, "measured: KV pool"),
                   (16, "default: vLLM's GPU block size"))
    measured = None
    if point.peak_kv_usage is not None and pool is not None:
        measured = measured_kv_bytes(point.peak_kv_usage, pool, per_token.value)
    overhead = _overhead(point, config, device, weights.value or 0, per_token.value, model)
    lora = _lora(config, device, model)
    facts = MemoryFacts(weights_bytes=int(weights.value or 0), overhead_bytes=int(overhead.value or 0),
                        margin=config.margin, kv_bytes_per_token=per_token.value,
                        tokens_per_request=int(tokens.value) if tokens.value is not None else None,
                        block_size=int(block.value or 16), measured_kv_bytes=measured, lora_bytes=int(lora.value or 0))
    sources = {"weights": weights.source, "kv_bytes_per_token": per_token.source,
               "tokens_per_request": tokens.source, "block_size": block.source, "overhead": overhead.source}
    if config.max_loras:
        sources["lora"] = lora.source
    return facts, sources


def _lora(config: PlanConfig, device: str, model: str) -> _Fact:
    """The LoRA slots' memory: max_loras x one slot at max_lora_rank (vLLM preallocates them on the device)."""
    if not config.max_loras:
        return _Fact(0, "LoRA off")
    if config.lora_gib is not None:
        return _Fact(config.lora_gib * GIB, "--lora-gib")
    if device == "cpu":
        return _Fact(0, "not counted on CPU: VLLM_CPU_KVCACHE_SPACE sizes only the KV pool")
    slot = modelinfo.lora_slot_bytes(model, config.max_lora_rank)
    if slot is None:
        raise MemoryPlanError(f"the LoRA slots' size of {model!r} is unknown (no config.json at hand): "
                              "give --lora-gib")
    return _Fact(slot[0] * config.max_loras, f"{config.max_loras} slots x ({slot[1]})")


def _overhead(point: ProfilePoint, config: PlanConfig, device: str, weights: float,
              per_token: float | None, model: str) -> _Fact:
    if config.overhead_gib is not None:
        return _Fact(config.overhead_gib * GIB, "--overhead-gib")
    if device == "cpu":
        return _Fact(0, "not needed on CPU: VLLM_CPU_KVCACHE_SPACE sizes only the KV pool")
    gpu, pool = point.gpu, point.kv_pool
    pool_bytes = (pool.bytes or (pool.tokens * per_token if per_token else None)) if pool else None
    if gpu and gpu.memory_used_max_bytes and gpu.memory_used_before_bytes is not None and pool_bytes:
        measured = gpu.memory_used_max_bytes - gpu.memory_used_before_bytes - weights - pool_bytes
        if measured > 0:
            return _Fact(measured, "measured: GPU memory the replica used - weights - KV pool")
    computed = modelinfo.non_kv_bytes(model, point.batch_size)
    if computed is not None:
        return _Fact(*computed)
    return _Fact(DEFAULT_GPU_OVERHEAD_GIB * GIB, f"default {DEFAULT_GPU_OVERHEAD_GIB:g} GiB (CUDA context, "
                                                 "activations, graphs); measure it with `planner profile --model`")


def make_plan(profile: Profile, config: PlanConfig) -> Plan:
    """The plan for this profile: replicas sized for B*, with the reasoning written into it."""
    choice = choose_batch(profile.points, config.choice)
    bca = bca_choice(profile.points, config.bca)
    device, model = _device(profile, config), _model(profile, config)
    point = profile.point(choice.batch_size)
    facts, sources = _memory_facts(profile, point, config, device, model)
    memory = replica_memory(facts, choice.batch_size)
    max_model_len, extra = split_vllm_args(profile.context.vllm_args)
    if device == "gpu":
        count, memory_args, layout = _gpu(profile, config, memory)
    else:
        count, memory_args, layout = _cpu(config, memory)
    speed = gateway_speed(profile)
    replicas = tuple(ReplicaSpec(name=f"r{i}", model=model, port=config.base_port + i,
                                 max_num_seqs=choice.batch_size, max_model_len=max_model_len, extra_args=extra,
                                 admission=Admission(max_requests=choice.batch_size), speed=speed,
                                 max_loras=config.max_loras,
                                 max_lora_rank=config.max_lora_rank if config.max_loras else None, **memory_args)
                     for i in range(count))
    queue = config.queue_size or max(1024, 4 * count * choice.batch_size)
    workers, rate = _workers(profile, choice, count)
    reasoning = _reasoning(profile, choice, bca, memory, sources, device, layout, config)
    reasoning["gateway_workers"] = {
        "workers": workers, "expected_output_tok_s": round(rate, 1),
        "rule": f"ceil(replicas x B*'s tokens/s x output share x {US_PER_EVENT:g} us per SSE event / "
                f"{WORKER_BUSY:g} of a core per worker), at least 1"}
    try:
        return Plan(model=model, replicas=replicas, reasoning=reasoning,
                    gateway=GatewaySpec(port=config.gateway_port, policy=config.policy, queue_size=queue,
                                        queue_wait_s=config.queue_wait_s, workers=workers))
    except PlanError as exc:
        raise PlannerError(f"the plan is not valid: {exc} (check --base-port and --gateway-port)") from exc


def _workers(profile: Profile, choice: Choice, count: int) -> tuple[int, float]:
    """The gateway's worker count for the output token rate the plan expects (every replica at B*)."""
    workload = profile.context.workload
    share = 1.0
    if workload.input_tokens and workload.output_tokens:
        share = workload.output_tokens / (workload.input_tokens + workload.output_tokens)
    rate = count * choice.chosen_tok_s * share  # chosen_tok_s counts prompt and output tokens
    return gateway_workers(rate), rate


def _gpu(profile: Profile, config: PlanConfig, memory: ReplicaMemory) -> tuple[int, dict[str, Any], dict[str, Any]]:
    device_bytes = (config.gpu_memory_gib * GIB if config.gpu_memory_gib is not None
                    else profile.context.gpu_memory_total_bytes)
    if not device_bytes:
        raise MemoryPlanError("the GPU's memory is unknown: give --gpu-memory-gib")
    layout = gpu_layout(memory, int(device_bytes), config.usable_fraction, config.replicas, config.max_replicas)
    if config.kv_cache_bytes_mode:
        kv_each = int(layout.fraction_each * layout.device_bytes) - memory.weights_bytes - memory.overhead_bytes
        args: dict[str, Any] = {"kv_cache_memory_bytes": kv_each}
    else:
        args = {"gpu_memory_utilization": layout.fraction_each}
    summary = layout.to_dict()
    summary["device_gib"] = gib(layout.device_bytes)
    summary["device_source"] = "--gpu-memory-gib" if config.gpu_memory_gib is not None else "measured: NVML"
    summary["rule"] = (f"replicas = floor({config.usable_fraction:g} x device / slice) = {layout.fit}"
                       + (f", capped at {layout.replicas}" if layout.replicas != layout.fit else "")
                       + f"; each gets {config.usable_fraction:g} / {layout.replicas} = {layout.fraction_each}"
                       " of the device (the papers' 0.9 / N)")
    return layout.replicas, args, summary


def _cpu(config: PlanConfig, memory: ReplicaMemory) -> tuple[int, dict[str, Any], dict[str, Any]]:
    count = config.replicas or min(DEFAULT_CPU_REPLICAS, config.max_replicas or DEFAULT_CPU_REPLICAS)
    space = cpu_kvcache_space_gib(memory.kv_bytes, config.margin)
    summary = {"replicas": count, "cpu_kvcache_space_gib": space,
               "replicas_source": "--replicas" if config.replicas else
               f"default {DEFAULT_CPU_REPLICAS}: CPU replicas share the cores and there is no device memory to "
               "divide; `planner validate` measures 1..N and keeps the best",
               "rule": f"VLLM_CPU_KVCACHE_SPACE = ceil(KV need x (1 + margin)) = {space} GiB (whole GiB, >= 1)"}
    return count, {"cpu_kvcache_space_gib": float(space)}, summary


def _reasoning(profile: Profile, choice: Choice, bca: Any, memory: ReplicaMemory, sources: dict[str, str],
               device: str, layout: dict[str, Any], config: PlanConfig) -> dict[str, Any]:
    table = [{"batch_size": c.batch_size, "total_tok_s": round(c.measured_tok_s, 1),
              "envelope_tok_s": None if c.envelope_tok_s is None else round(c.envelope_tok_s, 1),
              "excluded": c.excluded} for c in choice.candidates]
    memory_dict = memory.to_dict()
    memory_dict["margin"] = config.margin
    memory_dict["sources"] = sources
    head = (f"B* = {choice.batch_size} ({choice.chosen_tok_s:.0f} tok/s, within {choice.epsilon:.0%} of "
            f"{choice.best_tok_s:.0f} at B={choice.best_batch_size})")
    if device == "gpu":
        summary = (f"{head}; one replica needs {gib(memory.total_bytes)} GiB ({gib(memory.weights_bytes)} weights + "
                   f"{gib(memory.kv_bytes)} KV + {gib(memory.overhead_bytes)} overhead + "
                   + (f"{gib(memory.lora_bytes)} LoRA slots + " if memory.lora_bytes else "")
                   + f"{gib(memory.margin_bytes)} margin); {layout['replicas']} replica(s) at "
                   f"gpu_memory_utilization {layout['fraction_each']} each.")
    else:
        summary = (f"{head}; KV for B* requests {gib(memory.kv_bytes)} GiB -> VLLM_CPU_KVCACHE_SPACE "
                   f"{layout['cpu_kvcache_space_gib']} GiB per replica; {layout['replicas']} replica(s) on CPU.")
    reasoning: dict[str, Any] = _plain({
        "summary": summary,
        "warnings": plan_warnings(profile, choice),
        "profile": profile.context.source,
        "workload": asdict(profile.context.workload),
        "device": device,
        "batch": {
            "b_star": choice.batch_size,
            "rule": "the smallest profiled B whose total tokens/s, on a monotone (isotonic) envelope of the "
                    "measurements, is within epsilon of the best; points with preemptions, and points past the "
                    "peak by more than epsilon, excluded; only points meeting the latency SLOs",
            "epsilon": choice.epsilon,
            "best_tok_s": round(choice.best_tok_s, 1),
            "best_batch_size": choice.best_batch_size,
            "threshold_tok_s": round(choice.threshold_tok_s, 1),
            "slo": {k: v for k, v in vars(choice.slo).items() if v is not None},
            "points": table,
        },
        "bca": {**bca.to_dict(), "explanation": explain_difference(choice, bca, profile.points)},
        "memory": memory_dict,
        "layout": layout,
        "admission": f"the gateway sends each replica at most B* = {choice.batch_size} requests at once and "
                     "queues the rest, so no replica runs past its plateau",
    })
    return reasoning


def plan_warnings(profile: Profile, choice: Choice) -> list[str]:
    """What a reader of the plan should double-check."""
    warnings = []
    sizes = [c.batch_size for c in choice.candidates if c.envelope_tok_s is not None]
    if sizes and choice.best_batch_size == max(sizes):
        warnings.append(f"the best throughput is at the largest batch size profiled (B={choice.best_batch_size}): "
                        "the plateau may lie further out; profile larger batch sizes to be sure")
    failed = [p.batch_size for p in profile.points if p.failed_requests]
    if failed:
        warnings.append(f"some requests failed at B={failed}: those points may understate throughput")
    return warnings


def _plain(value: Any) -> Any:
    """Tuples to lists, recursively: plans are written with yaml.safe_dump."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_plan(plan: Plan, path: Path) -> None:
    """Write a plan file, making its directory; an unwritable path is a user error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        dump(plan, path)
    except OSError as exc:
        raise PlannerError(f"cannot write the plan to {str(path)!r}: {exc.strerror}") from exc
