"""`planner plan --models spec.yaml`: what several models on one device are, read and checked.

    device: gpu                    # gpu | cpu
    gpu: H100                      # for synthetic profiles (sim/gpus.py names); memory from it unless memory_gib
    memory_gib: 80                 # the device's memory (CPU: the RAM the replicas may take)
    usable_fraction: 0.9           # share of it all replicas together may use
    margin: 0.1                    # on each replica's slice
    slo: {p99_ttft_ms: 1000}       # the default goal; a model's own `slo` wins
    models:
      - name: chat                 # what clients put in `model`
        model: synthetic:qwen3-1.7b   # what vLLM loads (default: the profile's model, or `name`)
        profile: synthetic:qwen3-1.7b # a `planner profile` directory, a CSV, or synthetic:NAME (the simulator's estimate)
        traffic: {rate: 20, input_tokens: 512, output_tokens: 128}   # or {load_file: records.jsonl}
        slo: {p99_ttft_ms: 500}
      - {name: embed, kind: embed, model: tiny-embed, profile: planner/data/tiny-embed-cpu.csv,
         traffic: {rate: 50, input_tokens: 128}}

Every mistake names the model it is in.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.plan import MODEL_KINDS
from gateway.config import POLICY_NAMES
from planner.errors import PlannerError
from planner.packing import Goal

_MODEL_KEYS = {"name", "model", "kind", "profile", "traffic", "slo", "policy", "max_replicas", "max_model_len",
               "weights_gib", "kv_bytes_per_token", "overhead_gib", "extra_args"}
_SPEC_KEYS = {"device", "gpu", "memory_gib", "usable_fraction", "margin", "slo", "models", "base_port",
              "gateway_port", "policy", "queue_wait_s", "cpu_replica_gib", "max_replicas", "cpus"}


@dataclass(frozen=True)
class Traffic:
    """A model's expected load: requests/s and mean lengths (output 0 for an embedding model)."""

    rate: float
    input_tokens: int
    output_tokens: int
    source: str = "stated"

    @property
    def tokens_per_request(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"rate": round(self.rate, 4), "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "source": self.source}


@dataclass(frozen=True)
class ModelRequest:
    """One model to place: its names, kind, profile, traffic and goal."""

    name: str
    model: str
    kind: str
    profile: str
    traffic: Traffic
    goal: Goal
    policy: str | None = None
    max_replicas: int = 8
    max_model_len: int | None = None
    weights_gib: float | None = None
    kv_bytes_per_token: float | None = None
    overhead_gib: float | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class MultiSpec:
    """The whole request: the device and the models."""

    models: tuple[ModelRequest, ...]
    device: str = "gpu"
    gpu: str = "H100"
    memory_gib: float | None = None
    usable_fraction: float = 0.9
    margin: float = 0.1
    cpus: int = 2  # CPU plans: the cores the replicas share (default: this machine's)
    cpu_replica_gib: float = 3.0  # a vLLM-CPU replica's own RAM besides its KV space (measured ~3 GB here)
    base_port: int = 8001
    gateway_port: int = 8000
    policy: str | None = None
    queue_wait_s: float = 30.0
    source: str = ""


def _number(value: Any, where: str, *, integer: bool = False, allow_zero: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "integer" if integer else "number"
        raise PlannerError(f"{where} must be a {'non-negative' if allow_zero else 'positive'} {kind}, got {value!r}")
    return value


def load_traffic(data: Any, where: str, kind: str, base: Path) -> Traffic:
    """`{rate, input_tokens, output_tokens}` or `{load_file: records.jsonl}` (a `loadtest run --out` record)."""
    if not isinstance(data, dict):
        raise PlannerError(f"{where}: traffic must be a mapping {{rate, input_tokens, output_tokens}} or "
                           "{load_file: PATH}")
    unknown = sorted(set(data) - {"rate", "input_tokens", "output_tokens", "load_file"})
    if unknown:
        raise PlannerError(f"{where}: unknown traffic key(s) {', '.join(unknown)}")
    if "load_file" in data:
        recorded = recorded_traffic(base / str(data["load_file"]), where)
        rate = _number(data["rate"], f"{where}: traffic rate") if "rate" in data else recorded.rate
        return Traffic(rate, recorded.input_tokens, 0 if kind == "embed" else recorded.output_tokens,
                       recorded.source)
    if "rate" not in data or "input_tokens" not in data:
        raise PlannerError(f"{where}: traffic needs rate (requests/s) and input_tokens, or a load_file")
    output = data.get("output_tokens", 0 if kind == "embed" else None)
    if output is None:
        raise PlannerError(f"{where}: a generative model's traffic needs output_tokens")
    if kind == "embed" and output:
        raise PlannerError(f"{where}: an embedding model generates no tokens: drop output_tokens")
    return Traffic(_number(data["rate"], f"{where}: traffic rate"),
                   _number(data["input_tokens"], f"{where}: input_tokens", integer=True),
                   _number(output, f"{where}: output_tokens", integer=True, allow_zero=True))


def recorded_traffic(path: Path, where: str) -> Traffic:
    """Rate and mean lengths of a recorded load (`records.jsonl` from `loadtest run --out`)."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise PlannerError(f"{where}: cannot read load file {str(path)!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{where}: load file {str(path)!r} is not JSON lines: {exc}") from exc
    raw = [r.get("scheduled_s") if r.get("scheduled_s") is not None else r.get("sent_s") for r in lines
           if isinstance(r, dict)]
    times: list[float] = [float(t) for t in raw if isinstance(t, (int, float))]
    if len(times) < 2 or max(times) <= min(times):
        raise PlannerError(f"{where}: load file {str(path)!r} needs two or more requests with send times")
    prompts = [r.get("prompt_tokens") or r.get("requested_prompt_tokens") or 0 for r in lines]
    outputs = [r.get("max_tokens") or r.get("output_tokens") or 0 for r in lines]
    rate = (len(times) - 1) / (max(times) - min(times))
    return Traffic(rate, max(1, round(sum(prompts) / len(prompts))), round(sum(outputs) / len(outputs)),
                   f"recorded: {path} ({len(lines)} requests)")


def _goal(data: Any, where: str) -> Goal:
    if not isinstance(data, dict):
        raise PlannerError(f"{where}: slo must be a mapping like {{p99_ttft_ms: 500}}")
    unknown = sorted(set(data) - {"p99_ttft_ms", "p99_tpot_ms"})
    if unknown:
        raise PlannerError(f"{where}: unknown slo key(s) {', '.join(unknown)} (p99_ttft_ms, p99_tpot_ms)")
    try:
        return Goal(**data)
    except PlannerError as exc:
        raise PlannerError(f"{where}: {exc}") from None


def _model(data: Any, index: int, default_slo: dict[str, Any], base: Path, max_replicas: int) -> ModelRequest:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        raise PlannerError(f"models[{index}] must be a mapping with a name")
    name = data["name"]
    where = f"model {name!r}"
    unknown = sorted(set(data) - _MODEL_KEYS)
    if unknown:
        raise PlannerError(f"{where}: unknown key(s) {', '.join(unknown)}")
    kind = data.get("kind", "generate")
    if kind not in MODEL_KINDS:
        raise PlannerError(f"{where}: kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    profile = data.get("profile")
    if not isinstance(profile, str) or not profile:
        raise PlannerError(f"{where} has no profile: give `profile:` (a `planner profile` directory, a CSV, or "
                           "synthetic:NAME)")
    if not profile.startswith("synthetic:"):
        profile = str(base / profile)
    if "traffic" not in data:
        raise PlannerError(f"{where} has no traffic: give `traffic: {{rate, input_tokens, output_tokens}}`")
    policy = data.get("policy")
    if policy is not None and policy not in POLICY_NAMES:
        raise PlannerError(f"{where}: policy {policy!r} is not one of {', '.join(POLICY_NAMES)}")
    model = data.get("model") or (profile if profile.startswith("synthetic:") else name)
    optional = {key: _number(data[key], f"{where}: {key}") for key in ("weights_gib", "kv_bytes_per_token",
                                                                        "overhead_gib") if data.get(key) is not None}
    return ModelRequest(
        name=name, model=str(model), kind=kind, profile=profile,
        traffic=load_traffic(data["traffic"], where, kind, base),
        goal=_goal({**default_slo, **(data.get("slo") or {})}, where), policy=policy,
        max_replicas=_number(data.get("max_replicas", max_replicas), f"{where}: max_replicas", integer=True),
        max_model_len=(_number(data["max_model_len"], f"{where}: max_model_len", integer=True)
                       if data.get("max_model_len") is not None else None),
        extra_args=tuple(str(a) for a in data.get("extra_args") or ()), **optional)


def load_spec(path: str | Path) -> MultiSpec:
    """Read and check a models file; paths in it are relative to it."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PlannerError(f"cannot read models file {str(path)!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise PlannerError(f"models file {str(path)!r} is not valid YAML: {exc}") from exc
    return spec_from_dict(data, path.parent, str(path))


def spec_from_dict(data: Any, base: Path = Path("."), source: str = "") -> MultiSpec:
    """A `MultiSpec` from parsed YAML."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise PlannerError("a models file is a mapping with a non-empty list `models:`")
    unknown = sorted(set(data) - _SPEC_KEYS)
    if unknown:
        raise PlannerError(f"models file: unknown key(s) {', '.join(unknown)}")
    device = data.get("device", "gpu")
    if device not in ("gpu", "cpu"):
        raise PlannerError(f"device must be gpu or cpu, got {device!r}")
    slo = data.get("slo") or {}
    _goal(slo, "the default slo")
    max_replicas = _number(data.get("max_replicas", 8), "max_replicas", integer=True)
    models = tuple(_model(m, i, slo, base, max_replicas) for i, m in enumerate(data["models"]))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise PlannerError(f"models are listed twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    usable, margin = data.get("usable_fraction", 0.9), data.get("margin", 0.1)
    if not (isinstance(usable, (int, float)) and 0 < usable <= 1):
        raise PlannerError(f"usable_fraction must be in (0, 1], got {usable!r}")
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise PlannerError(f"margin must be in [0, 1), got {margin!r}")
    policy = data.get("policy")
    if policy is not None and policy not in POLICY_NAMES:
        raise PlannerError(f"policy {policy!r} is not one of {', '.join(POLICY_NAMES)}")
    return MultiSpec(
        models=models, device=device, gpu=str(data.get("gpu", "H100")),
        memory_gib=_number(data["memory_gib"], "memory_gib") if data.get("memory_gib") is not None else None,
        usable_fraction=float(usable), margin=float(margin),
        cpu_replica_gib=_number(data.get("cpu_replica_gib", 3.0), "cpu_replica_gib"),
        cpus=_number(data.get("cpus", len(os.sched_getaffinity(0))), "cpus", integer=True),
        base_port=_number(data.get("base_port", 8001), "base_port", integer=True),
        gateway_port=_number(data.get("gateway_port", 8000), "gateway_port", integer=True),
        policy=policy, queue_wait_s=_number(data.get("queue_wait_s", 30.0), "queue_wait_s"), source=source)
