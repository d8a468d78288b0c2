"""Several models on one device: from a models file to a plan `deploy up --plan` runs, with why, and the baselines.

Each model gets `replicas` replicas capped at B, named `NAME-rK`, served as NAME; on a GPU each replica's
`gpu_memory_utilization` is its slice scaled so that all slices together take the usable share (what packing
left over becomes KV cache, spread in proportion); on CPU each gets its `cpu_kvcache_space_gib`. The plan's
`models:` section carries each model's kind, its gateway policy and queue, and the traffic and goal it was sized
for. `reasoning.multimodel.baselines` holds the same prediction for the obvious alternatives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from deploy.plan import Admission, GatewaySpec, ModelEntry, Plan, PlanError, ReplicaSpec, gateway_workers
from deploy.tinyembed import TINY_EMBED_NAME, default_embed_dir
from deploy.tinymodel import TINY_MODEL_NAME, default_model_dir
from gateway.config import DEFAULT_POLICY
from planner.errors import PlannerError
from planner.modelspeed import replica_bytes, speed_points
from planner.multimodel import ModelRequest, MultiSpec
from planner.packing import (GIB, Demand, Option, Packing, common_headroom, device_load, headroom, options,
                             p99_ttft_ms, pack)
from planner.sources import load_profile

DEFAULT_BATCH = {"gpu": 128, "cpu": 32}  # what `deploy up` gives each replica without a plan
POLICY_BY_KIND = {"generate": DEFAULT_POLICY, "embed": "least_outstanding_tokens"}  # no prefix to keep for embeddings
POOLING = ("--runner", "pooling")


def facts_source(model: str) -> str:
    """Where the model's config.json is for memory facts: the tiny models' cache directories, else the name."""
    if model in ("tiny", TINY_MODEL_NAME):
        return str(default_model_dir())
    if model == TINY_EMBED_NAME:
        return str(default_embed_dir())
    return model


def device_bytes(spec: MultiSpec) -> int:
    if spec.memory_gib is not None:
        return int(spec.memory_gib * GIB)
    if spec.device == "cpu":
        raise PlannerError("a CPU plan needs memory_gib: the RAM its replicas may take")
    from sim.gpus import get_gpu

    try:
        return int(get_gpu(spec.gpu).memory_bytes)
    except ValueError as exc:
        raise PlannerError(f"{exc} (or give memory_gib)") from None


def demands(spec: MultiSpec) -> list[Demand]:
    found = []
    for request in spec.models:
        if request.profile.startswith("synthetic:"):
            if spec.device == "cpu":
                raise PlannerError(f"model {request.name!r}: a synthetic profile is a GPU estimate; a CPU plan needs "
                                   "a measured profile (`planner profile`)")
            profile = None
        else:
            try:
                profile = load_profile(request.profile)
            except PlannerError as exc:
                raise PlannerError(f"model {request.name!r}: {exc}") from None
        points = speed_points(request, spec, profile, facts_source(request.model))
        limit = request.max_replicas
        if spec.device == "cpu":  # a CPU replica is pinned to its own cores: the cores, split evenly, bound the count
            limit = min(limit, max(1, spec.cpus // len(spec.models)))
        found.append(Demand(request.name, request.traffic.rate, request.goal, points, limit))
    return found


@dataclass(frozen=True)
class MultiPlan:
    """The plan and the packing it came from."""

    plan: Plan
    packing: Packing


def make_multi_plan(spec: MultiSpec) -> MultiPlan:
    """Pack the models onto the device and write the plan."""
    total = device_bytes(spec)
    budget = int(spec.usable_fraction * total)
    wanted = demands(spec)
    packing = pack(wanted, budget)
    scale = budget / packing.used_bytes if spec.device == "gpu" else 1.0
    replicas, entries, port = [], [], spec.base_port
    for request, option in zip(spec.models, packing.chosen):
        for k in range(option.replicas):
            if port == spec.gateway_port:
                port += 1
            replicas.append(_replica(request, option, spec, total, scale, k, port))
            port += 1
        entries.append(ModelEntry(
            name=request.name, kind=request.kind, policy=request.policy or POLICY_BY_KIND[request.kind],
            queue_size=max(64, 4 * option.replicas * option.batch_size), queue_wait_s=spec.queue_wait_s,
            traffic=request.traffic.to_dict(),
            slo={k: v for k, v in (("p99_ttft_ms", request.goal.p99_ttft_ms),
                                   ("p99_tpot_ms", request.goal.p99_tpot_ms)) if v is not None}))
    output_rate = sum(r.traffic.rate * r.traffic.output_tokens * o.headroom for r, o in zip(spec.models, packing.chosen))
    gateway = GatewaySpec(port=spec.gateway_port, policy=spec.policy or DEFAULT_POLICY,
                          queue_size=sum(e.queue_size or 0 for e in entries), queue_wait_s=spec.queue_wait_s,
                          workers=gateway_workers(output_rate))
    reasoning = _reasoning(spec, wanted, packing, total)
    try:
        plan = Plan(model=" + ".join(r.name for r in spec.models), replicas=tuple(replicas), gateway=gateway,
                    reasoning=reasoning, models=tuple(entries))
    except PlanError as exc:
        raise PlannerError(f"the plan is not valid: {exc} (check base_port and gateway_port)") from exc
    return MultiPlan(plan, packing)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:50] or "model"


def _replica(request: ModelRequest, option: Option, spec: MultiSpec, total: int, scale: float, k: int,
             port: int) -> ReplicaSpec:
    extra = tuple(request.extra_args)
    if request.kind == "embed" and "--runner" not in extra:
        extra = (*POOLING, *extra)
    memory: dict[str, Any] = {}
    if spec.device == "gpu":
        memory["gpu_memory_utilization"] = int(option.point.replica_bytes * scale / total * 10_000) / 10_000
    else:
        memory["cpu_kvcache_space_gib"] = replica_bytes(request, spec, facts_source(request.model),
                                                        option.batch_size)[1]
    return ReplicaSpec(name=f"{_slug(request.name)}-r{k}", model=request.model, port=port,
                       max_num_seqs=option.batch_size, max_model_len=request.max_model_len, extra_args=extra,
                       admission=Admission(max_requests=option.batch_size), served_model_name=request.name,
                       **memory)


def _option_dict(option: Option, rate: float) -> dict[str, Any]:
    return {"replicas": option.replicas, "batch_size": option.batch_size,
            "memory_gib": round(option.memory_bytes / GIB, 3), "headroom": round(option.headroom, 3),
            "predicted_p99_ttft_ms": None if option.p99_ttft_ms == float("inf") else round(option.p99_ttft_ms, 1),
            "capacity_rps": round(option.replicas * option.point.capacity_rps, 3), "rate": rate}


def _reasoning(spec: MultiSpec, wanted: list[Demand], packing: Packing, total: int) -> dict[str, Any]:
    per_model = {}
    for request, option in zip(spec.models, packing.chosen):
        per_model[request.name] = {**_option_dict(option, request.traffic.rate), "kind": request.kind,
                                   "profile": request.profile, "model": request.model}
    binding = min(packing.chosen, key=lambda o: o.headroom)
    warnings = []
    if spec.device == "gpu" and packing.min_headroom < binding.headroom:
        warnings.append(f"the device's compute is the limit: the stated traffic needs {packing.device_load:.2f} of "
                        f"the device's time, so every model together carries {packing.min_headroom:.2f} x its "
                        "traffic")
    lines = [f"{o.name}: {o.replicas} x B={o.batch_size}, {o.memory_bytes / GIB:.2f} GiB, carries "
             f"{o.headroom:.2f} x its traffic alone (predicted p99 TTFT {o.p99_ttft_ms:.0f} ms)"
             for o in packing.chosen]
    summary = (f"{len(packing.chosen)} models on one {spec.device} ({total / GIB:.1f} GiB, "
               f"{spec.usable_fraction:g} usable): " + "; ".join(lines) +
               f". Together every model carries {packing.min_headroom:.2f} x its traffic (the least alone: "
               f"{binding.name}'s)" + (f"; the traffic needs {packing.device_load:.2f} of the device's time."
                                       if spec.device == "gpu" else "."))
    return {"summary": summary, "warnings": warnings, "multimodel": {
        "device_load": round(packing.device_load, 3),
        "device": spec.device, "gpu": spec.gpu if spec.device == "gpu" else None,
        "memory_gib": round(total / GIB, 3), "usable_gib": round(packing.budget_bytes / GIB, 3),
        "packed_gib": round(packing.used_bytes / GIB, 3), "min_headroom": round(packing.min_headroom, 3),
        "models": per_model, "baselines": baselines(spec, wanted, packing.budget_bytes),
        "rule": "each model: r replicas at cap B; per replica an M/M/B queue at rate / r (Erlang C p99 wait) on "
                "top of the p99 TTFT with the batch full; headroom = the largest factor on the traffic within the "
                "goal; the packing maximizes the smallest headroom within the usable memory, then spends the "
                "rest on the model with the least"}}


def baselines(spec: MultiSpec, wanted: list[Demand], budget: int) -> dict[str, Any]:
    """The same prediction for the obvious alternatives: an equal memory split (each model's best option within
    its share), and one replica each at the default share (deploy's default batch cap, usable / models)."""
    share = budget // len(wanted)
    rates = {d.name: d.rate for d in wanted}
    equal: list[Option] = []
    default: list[Option] = []
    notes: dict[str, str] = {}
    for demand in wanted:
        fitting = [o for o in options(demand) if o.memory_bytes <= share]
        if fitting:
            equal.append(max(fitting, key=lambda o: common_headroom([o], rates)))
        else:
            notes[demand.name] = "equal split: not one replica fits in its share"
        target = DEFAULT_BATCH[spec.device]
        point = min(demand.points, key=lambda p: (abs(p.batch_size - target), -p.batch_size))
        room = headroom(point, 1, demand.rate, demand.goal) if point.replica_bytes <= share else 0.0
        default.append(Option(demand.name, 1, point, room, p99_ttft_ms(point, 1, demand.rate)))
        if point.replica_bytes > share:
            notes[demand.name] = (f"one replica each: B={point.batch_size} needs {point.replica_bytes / GIB:.2f} GiB, "
                                  f"more than its {share / GIB:.2f} GiB share (vLLM would preempt)")
    return {"equal_split": _baseline(equal, rates, len(wanted)),
            "one_replica_each": _baseline(default, rates, len(wanted)), "notes": notes}


def _baseline(chosen: list[Option], rates: dict[str, float], count: int) -> dict[str, Any]:
    models = {o.name: _option_dict(o, rates[o.name]) for o in chosen}
    room = common_headroom(chosen, rates) if len(chosen) == count and all(o.headroom > 0 for o in chosen) else 0.0
    return {"models": models, "min_headroom": round(room, 3), "device_load": round(device_load(chosen, rates), 3)}


def _finite(value: float) -> float | None:
    return None if value == float("inf") else round(value, 1)

