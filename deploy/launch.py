"""From a plan (or flags) and the hardware to what gets started: replica specs, their environments, the gateway config."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from deploy.hardware import Hardware, cpu_list, split_cpus
from deploy.models import ResolvedModel
from deploy.plan import Admission, GatewaySpec, Plan, ReplicaSpec
from gateway.config import DEFAULT_POLICY

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "facebook/opt-125m"
DEFAULT_REPLICAS = 2
DEFAULT_PORT = 8000
CPU_KV_CACHE_GIB = 1.0  # small on purpose: each CPU replica also needs ~3 GB for itself
CPU_MAX_NUM_SEQS = 32
GPU_MAX_NUM_SEQS = 128
GPU_MEMORY_TOTAL = 0.9  # the share of the GPU all replicas together may take
QUEUE_SIZE = 1024
QUEUE_WAIT_S = 60.0
POOLING_FLAGS = ("--runner", "pooling")  # an embedding model: vLLM's pooling runner (vLLM 0.10+)


@dataclass(frozen=True)
class PlanOptions:
    """What `deploy up` was told on the command line when it has no plan file."""

    model: str = DEFAULT_MODEL
    replicas: int = DEFAULT_REPLICAS
    port: int = DEFAULT_PORT
    replica_port_base: int | None = None  # default: port + 1
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    cpu_kvcache_space_gib: float | None = None
    policy: str = DEFAULT_POLICY
    extra_args: tuple[str, ...] = ()
    max_loras: int | None = None  # LoRA on: adapters each replica holds at once
    max_lora_rank: int | None = None
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters the gateway may load: (name, path)

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas must be a positive integer, got {self.replicas!r}")
        base = self.port + 1 if self.replica_port_base is None else self.replica_port_base
        if not 0 < base or base + self.replicas - 1 > 65535:
            raise ValueError(f"replica ports {base}..{base + self.replicas - 1} are not all in 1..65535")


@dataclass(frozen=True)
class Launch:
    """One replica ready to start: its spec (model resolved) and the environment additions it needs."""

    spec: ReplicaSpec
    env: Mapping[str, str]
    cpus: tuple[int, ...] = ()  # on CPU: the cores the replica's processes are confined to (empty: any)


def default_plan(options: PlanOptions, hardware: Hardware) -> Plan:
    """A plan from flags: N equal replicas of one model, sized for the GPU's share or for this CPU."""
    gpu = bool(hardware.gpus)
    seqs = options.max_num_seqs or (GPU_MAX_NUM_SEQS if gpu else CPU_MAX_NUM_SEQS)
    fraction = options.gpu_memory_utilization
    if gpu and fraction is None:
        fraction = math.floor(GPU_MEMORY_TOTAL / options.replicas * 100) / 100
    base = options.port + 1 if options.replica_port_base is None else options.replica_port_base
    replicas = tuple(
        ReplicaSpec(name=f"r{i}", model=options.model, port=base + i, max_num_seqs=seqs,
                    max_model_len=options.max_model_len, gpu_memory_utilization=fraction if gpu else None,
                    cpu_kvcache_space_gib=None if gpu else (options.cpu_kvcache_space_gib or CPU_KV_CACHE_GIB),
                    extra_args=options.extra_args, admission=Admission(max_requests=seqs),
                    max_loras=options.max_loras, max_lora_rank=options.max_lora_rank)
        for i in range(options.replicas))
    gateway = GatewaySpec(port=options.port, policy=options.policy, queue_size=QUEUE_SIZE, queue_wait_s=QUEUE_WAIT_S)
    return Plan(model=options.model, replicas=replicas, gateway=gateway,
                reasoning={"source": "deploy up flags (no plan file)"}, adapters=dict(options.adapters))


def with_models(plan: Plan, resolved: Mapping[str, ResolvedModel], gpu: bool = False) -> Plan:
    """The plan with each replica's model replaced by what vLLM loads (a local path for the tiny and synthetic
    models) and the flags that model needs on this device."""
    replicas = []
    embed = {m.name for m in plan.models if m.kind == "embed"}
    for spec in plan.replicas:
        model = resolved[spec.model]
        needed = model.vllm_flags(gpu)
        if (spec.served_model_name or spec.model) in embed:
            needed = (POOLING_FLAGS, *needed)
        extra = (*spec.extra_args, *missing_flags(needed, spec.extra_args))
        if spec.max_model_len is None and model.default_max_model_len is not None \
                and "--max-model-len" not in flag_names(extra):
            spec = replace(spec, max_model_len=model.default_max_model_len)
        replicas.append(replace(spec, model=model.source, extra_args=extra,
                                served_model_name=spec.served_model_name or model.served_name))
    return replace(plan, replicas=tuple(replicas))


def flag_names(args: tuple[str, ...]) -> set[str]:
    """The `--flag` names in a vLLM argument list (given as `--flag value` or `--flag=value`)."""
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def missing_flags(flags: tuple[tuple[str, ...], ...], given: tuple[str, ...]) -> tuple[str, ...]:
    """The flag groups whose flag the user did not give already (as `--flag` or `--flag=value`)."""
    names = flag_names(given)
    return tuple(part for group in flags if group[0] not in names for part in group)


def fit_to_hardware(plan: Plan, hardware: Hardware) -> Plan:
    """Fill in what the hardware needs and the plan left open: a GPU share each, or a CPU KV cache size."""
    n = len(plan.replicas)
    replicas = []
    for spec in plan.replicas:
        if hardware.gpus and spec.gpu_memory_utilization is None and spec.kv_cache_memory_bytes is None:
            share = math.floor(GPU_MEMORY_TOTAL / n * 100) / 100
            logger.warning("replica %s names no GPU memory share; giving it %.2f", spec.name, share)
            spec = replace(spec, gpu_memory_utilization=share)
        if not hardware.gpus and spec.cpu_kvcache_space_gib is None:
            spec = replace(spec, cpu_kvcache_space_gib=CPU_KV_CACHE_GIB)
        replicas.append(spec)
    return replace(plan, replicas=tuple(replicas))


def launches(plan: Plan, hardware: Hardware, extra_env: Mapping[str, str] | None = None) -> list[Launch]:
    """Each replica's spec and environment; on CPU, each replica is confined to its own cores.

    vLLM pins the replica's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND), and the replica's every process starts with
    only those cores allowed: at `import torch`, MKL counts cores by moving the process onto each allowed CPU in
    turn, and a process moved onto a core where another replica's pinned worker spins got no CPU time for minutes
    on this project's CI VM (and could not be killed meanwhile).
    """
    extra = dict(extra_env or {})
    if hardware.gpus:
        return [Launch(spec, dict(extra)) for spec in plan.replicas]
    if len(hardware.cpus) < len(plan.replicas):
        logger.warning("%d replicas on %d CPU cores: some replicas share a core", len(plan.replicas),
                       len(hardware.cpus))
    slices = split_cpus(hardware.cpus, len(plan.replicas))
    return [Launch(spec, {**extra, "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus)}, tuple(cpus))
            for spec, cpus in zip(plan.replicas, slices)]


def replica_url(spec: ReplicaSpec, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{spec.port}"


def gateway_config(plan: Plan, *, host: str = "0.0.0.0", replica_host: str = "127.0.0.1",
                   tokenizers: Mapping[str, str] | None = None, log_level: str = "info",
                   admin_key: str | None = None) -> dict[str, Any]:
    """The gateway's YAML config (see gateway/config.py) for the plan's replicas and admission caps."""
    replicas = []
    for spec in plan.replicas:
        entry: dict[str, Any] = {"url": replica_url(spec, replica_host), "name": spec.name, "weight": 1.0}
        if spec.max_num_seqs is not None:
            entry["max_num_seqs"] = spec.max_num_seqs
        if spec.speed is not None:
            entry["speed"] = spec.speed
        if spec.admission.max_requests is not None:
            entry["max_requests"] = spec.admission.max_requests
        if spec.admission.max_outstanding_tokens is not None:
            entry["max_outstanding_tokens"] = spec.admission.max_outstanding_tokens
        replicas.append(entry)
    config: dict[str, Any] = {
        "host": host, "port": plan.gateway.port, "policy": plan.gateway.policy, "replicas": replicas,
        "queue": {"max_size": plan.gateway.queue_size, "max_wait_s": plan.gateway.queue_wait_s},
        "health": {"interval_s": 1.0, "timeout_s": 2.0}, "log_level": log_level,
        "workers": plan.gateway.workers,
    }
    models = model_settings(plan)
    if models:
        config["models"] = models
    if tokenizers:
        config["tokenizers"] = dict(tokenizers)
    slots = [spec.max_loras for spec in plan.replicas if spec.max_loras]
    if plan.adapters and slots:
        config["lora"] = {"adapters": dict(plan.adapters), "max_loras": min(slots)}
    if admin_key:
        config["admin_key"] = admin_key
    return config


def model_settings(plan: Plan) -> dict[str, dict[str, Any]]:
    """Each model's own gateway settings (its policy, its queue), for the models of a multi-model plan."""
    settings: dict[str, dict[str, Any]] = {}
    for entry in plan.models:
        item: dict[str, Any] = {}
        if entry.policy is not None:
            item["policy"] = entry.policy
        if entry.queue_size is not None:
            item["queue"] = {"max_size": entry.queue_size,
                             "max_wait_s": entry.queue_wait_s or plan.gateway.queue_wait_s}
        settings[entry.name] = item
    return settings


def local_tokenizers(plan: Plan) -> dict[str, str]:
    """Served name -> model directory, for replicas that load a local directory (the gateway counts tokens with it)."""
    return {spec.served_model_name: spec.model for spec in plan.replicas
            if spec.served_model_name and spec.model.startswith("/")}
