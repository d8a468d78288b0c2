"""The deployment plan: what `planner plan` writes and `deploy up --plan` runs.

    model: facebook/opt-1.3b
    gateway: {port: 8000, policy: prefix_affinity, queue_size: 1024, queue_wait_s: 30, workers: 1}
    replicas:
      - name: r0
        model: facebook/opt-1.3b
        port: 8001
        max_num_seqs: 256
        max_model_len: 2048
        gpu_memory_utilization: 0.45      # a per-instance fraction (GPU), or
        kv_cache_memory_bytes: null       # a KV pool size in bytes (GPU), or
        cpu_kvcache_space_gib: null       # VLLM_CPU_KVCACHE_SPACE (CPU build)
        extra_args: []
        admission: {max_requests: 256, max_outstanding_tokens: null}
        served_model_name: null           # optional: the name clients ask for (default: model)
        max_loras: null                   # LoRA: adapters held at once (vLLM --enable-lora --max-loras); null: off
        max_lora_rank: null               # LoRA: the largest adapter rank (vLLM --max-lora-rank; default 16)
        speed: {step_s: {1: 0.0036, 256: 0.031}, prefill_tokens_s: 200000}   # optional: measured, for the gateway
    models:                               # optional: several models on one device (docs/multimodel.md)
      - {name: facebook/opt-1.3b, kind: generate, policy: prefix_affinity, queue_size: 1024, queue_wait_s: 30,
         traffic: {rate: 20, input_tokens: 512, output_tokens: 128}, slo: {p99_ttft_ms: 500}}
    adapters: {sql: /models/sql-lora}     # LoRA adapters the gateway may load (name -> path or repository)
    reasoning: {...}                      # free-form: B*, the rule, the numbers it came from
    validation: {...}                     # free-form: what `planner validate` measured

A plan without `models:` serves one model (or whatever models its replicas name, with the gateway's settings);
with it, each entry names a model its replicas serve (by `served_model_name`, else `model`) and that model's own
gateway settings.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.config import DEFAULT_POLICY, POLICY_NAMES
from gateway.speed import Speed, SpeedError


class PlanError(ValueError):
    """A plan file or value is wrong; the message names it."""


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM 0.32 accepts for --max-lora-rank


@dataclass(frozen=True)
class Admission:
    """The gateway's admission caps for one replica (None: uncapped)."""

    max_requests: int | None = None
    max_outstanding_tokens: int | None = None


@dataclass(frozen=True)
class ReplicaSpec:
    """How to launch one vLLM replica."""

    name: str
    model: str
    port: int
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    cpu_kvcache_space_gib: float | None = None
    extra_args: tuple[str, ...] = ()
    admission: Admission = field(default_factory=Admission)
    served_model_name: str | None = None  # the name clients use (vLLM's --served-model-name); None: `model`
    speed: dict[str, Any] | None = None  # the gateway's speed model of it (gateway/speed.py), from the profile
    max_loras: int | None = None  # LoRA adapters held at once (vLLM's --max-loras); None: LoRA off
    max_lora_rank: int | None = None  # the largest adapter rank it takes (vLLM's --max-lora-rank)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise PlanError(f"replica {self.name!r} port must be 1..65535, got {self.port!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError(f"replica {self.name!r} gpu_memory_utilization must be in (0, 1], "
                            f"got {self.gpu_memory_utilization!r}")
        if self.max_lora_rank is not None and self.max_lora_rank not in LORA_RANKS:
            raise PlanError(f"replica {self.name!r} max_lora_rank must be one of {LORA_RANKS} (vLLM's), "
                            f"got {self.max_lora_rank!r}")
        if self.max_lora_rank is not None and self.max_loras is None:
            raise PlanError(f"replica {self.name!r} has max_lora_rank but no max_loras (LoRA is off)")
        for name in ("max_num_seqs", "max_model_len", "kv_cache_memory_bytes", "max_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise PlanError(f"replica {self.name!r} {name} must be a positive integer, got {value!r}")
        if self.cpu_kvcache_space_gib is not None and self.cpu_kvcache_space_gib <= 0:
            raise PlanError(f"replica {self.name!r} cpu_kvcache_space_gib must be positive")
        if self.speed is not None:
            try:
                Speed.from_mapping(self.speed, f"replica {self.name!r} speed")
            except SpeedError as exc:
                raise PlanError(str(exc)) from None


@dataclass(frozen=True)
class GatewaySpec:
    """How to run the gateway in front of the replicas."""

    port: int = 8000
    policy: str = DEFAULT_POLICY
    queue_size: int = 0
    queue_wait_s: float = 30.0
    workers: int = 1  # gateway worker processes (planner: from the expected token rate, see `gateway_workers`)

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise PlanError(f"gateway workers must be a positive integer, got {self.workers!r}")


MODEL_KINDS = ("generate", "embed")


@dataclass(frozen=True)
class ModelEntry:
    """One model of a multi-model plan: what clients call it, its kind, its gateway settings, what it was sized for."""

    name: str
    kind: str = "generate"  # generate | embed (vLLM's pooling runner)
    policy: str | None = None  # None: the gateway's
    queue_size: int | None = None  # None: the gateway's shared queue
    queue_wait_s: float | None = None
    traffic: dict[str, Any] = field(default_factory=dict)  # free-form: what the planner sized it for
    slo: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"a model entry needs a name, got {self.name!r}")
        if self.kind not in MODEL_KINDS:
            raise PlanError(f"model {self.name!r} kind must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}")
        if self.policy is not None and self.policy not in POLICY_NAMES:
            raise PlanError(f"model {self.name!r} policy {self.policy!r} is not one of {', '.join(POLICY_NAMES)}")
        if self.queue_size is not None and (not isinstance(self.queue_size, int) or self.queue_size < 0):
            raise PlanError(f"model {self.name!r} queue_size must be an integer >= 0, got {self.queue_size!r}")
        if self.queue_wait_s is not None and not self.queue_wait_s > 0:
            raise PlanError(f"model {self.name!r} queue_wait_s must be positive, got {self.queue_wait_s!r}")


US_PER_EVENT = 21.0  # the gateway's CPU per relayed SSE event, one event per read (issue #11, measured)
WORKER_BUSY = 0.5  # plan each worker for at most half a core of relaying: headroom for bursts and parsing


def gateway_workers(output_tokens_per_s: float) -> int:
    """Worker processes for an expected output token rate: one SSE event per token at US_PER_EVENT each."""
    return max(1, math.ceil(output_tokens_per_s * US_PER_EVENT * 1e-6 / WORKER_BUSY))


@dataclass(frozen=True)
class Plan:
    """A whole deployment: the replicas, the gateway, and why."""

    model: str
    replicas: tuple[ReplicaSpec, ...]
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    reasoning: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)
    models: tuple[ModelEntry, ...] = ()  # several models: each one's kind and gateway settings (empty: one model)
    adapters: dict[str, Any] = field(default_factory=dict)  # LoRA: name -> path or {path, base} (the gateway's)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise PlanError("a plan needs at least one replica")
        if self.adapters and not any(r.max_loras for r in self.replicas):
            raise PlanError("the plan names LoRA adapters but no replica has max_loras (LoRA is off)")
        ports = [r.port for r in self.replicas] + [self.gateway.port]
        if len(set(ports)) != len(ports):
            raise PlanError(f"ports collide in the plan: {ports}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise PlanError(f"models are listed twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        served = {served_name(r) for r in self.replicas}
        for name in names:
            if name not in served:
                raise PlanError(f"model {name!r} has no replica in the plan (replicas serve {sorted(served)})")

    def replicas_of(self, name: str) -> tuple[ReplicaSpec, ...]:
        """The replicas that serve the model clients call `name`."""
        return tuple(r for r in self.replicas if served_name(r) == name)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for replica in data["replicas"]:
            replica["extra_args"] = list(replica["extra_args"])
        data["replicas"] = list(data["replicas"])
        if self.models:
            data["models"] = list(data["models"])
        else:
            del data["models"]  # a one-model plan reads as it always did
        return data


def served_name(spec: ReplicaSpec) -> str:
    """The name clients ask a replica for."""
    return spec.served_model_name or spec.model


def _replica(data: Any, index: int) -> ReplicaSpec:
    if not isinstance(data, dict):
        raise PlanError(f"replicas[{index}] must be a mapping")
    data = dict(data)
    data.setdefault("name", f"r{index}")
    data["admission"] = Admission(**(data.get("admission") or {}))
    data["extra_args"] = tuple(str(a) for a in data.get("extra_args") or ())
    try:
        return ReplicaSpec(**data)
    except TypeError as exc:
        raise PlanError(f"replicas[{index}]: {exc}") from exc


def _model_entry(data: Any, index: int) -> ModelEntry:
    if not isinstance(data, dict):
        raise PlanError(f"models[{index}] must be a mapping")
    try:
        return ModelEntry(**data)
    except TypeError as exc:
        raise PlanError(f"models[{index}]: {exc}") from exc


def from_dict(data: Any) -> Plan:
    """Build a plan from a parsed YAML mapping, naming any bad key or value."""
    if not isinstance(data, dict) or "replicas" not in data or "model" not in data:
        raise PlanError("a plan is a mapping with at least `model` and `replicas`")
    try:
        return Plan(
            model=str(data["model"]),
            replicas=tuple(_replica(r, i) for i, r in enumerate(data["replicas"] or [])),
            gateway=GatewaySpec(**(data.get("gateway") or {})),
            reasoning=dict(data.get("reasoning") or {}),
            validation=dict(data.get("validation") or {}),
            models=tuple(_model_entry(m, i) for i, m in enumerate(data.get("models") or [])),
            adapters=dict(data.get("adapters") or {}),
        )
    except TypeError as exc:
        raise PlanError(f"plan: {exc}") from exc


def load(path: str | Path) -> Plan:
    """Read a plan file."""
    try:
        return from_dict(yaml.safe_load(Path(path).read_text()))
    except OSError as exc:
        raise PlanError(f"cannot read plan {str(path)!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise PlanError(f"plan {str(path)!r} is not valid YAML: {exc}") from exc


def dump(plan: Plan, path: str | Path) -> None:
    """Write a plan file."""
    Path(path).write_text(yaml.safe_dump(plan.to_dict(), sort_keys=False))
