"""`planner validate` for a multi-model plan: the packed plan against the obvious alternatives, measured.

Each arrangement (the plan as packed; an equal split; one replica each at the default share, as the planner's
`reasoning.multimodel.baselines` describe them) is deployed with `deploy up --plan` in turn, and the same mixed
open-loop Poisson traffic is sent through the gateway: every model at its planned rate x `scale`, streaming
completions for generative models and embeddings for embedding models, for `duration_s`. Per model: requests,
failures, p99 TTFT (an embedding's whole latency) and the share within its goal; per arrangement: goodput, the
requests/s that met their model's goal. The comparison goes into the plan's `validation:`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from deploy.plan import ModelEntry, Plan, ReplicaSpec
from planner.client import RequestResult, Timeouts, load_session, stream_completion
from planner.errors import PlannerError, RunError
from planner.multiplan import facts_source
from planner.validate import Deployer
from planner.workload import ApproximatePrompts, PromptBuilder, RequestSpec, prompt_builder

ARRANGEMENTS = ("packed", "equal_split", "one_replica_each")


@dataclass(frozen=True)
class MultiValidateConfig:
    """How long and how hard to drive each arrangement."""

    duration_s: float = 60.0
    scale: float = 1.0
    seed: int = 0
    arrangements: tuple[str, ...] = ARRANGEMENTS
    timeouts: Timeouts = Timeouts(request_s=120.0)

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and self.scale > 0):
            raise PlannerError("--duration and --scale must be positive")
        unknown = sorted(set(self.arrangements) - set(ARRANGEMENTS))
        if unknown:
            raise PlannerError(f"unknown arrangement(s) {unknown}: choose from {', '.join(ARRANGEMENTS)}")


def arrangement(plan: Plan, name: str) -> Plan:
    """The plan as packed, or rearranged as a baseline of its reasoning (same models, ports from the same base)."""
    if name == "packed":
        return replace(plan, validation={})
    baselines = (plan.reasoning.get("multimodel") or {}).get("baselines") or {}
    layout = (baselines.get(name) or {}).get("models")
    if not layout:
        raise PlannerError(f"the plan has no {name} baseline (plan it again with `planner plan --models`)")
    usable = sum(r.gpu_memory_utilization or 0 for r in plan.replicas)
    share = usable / len(plan.models)
    ports = (p for p in range(min(r.port for r in plan.replicas), 65536) if p != plan.gateway.port)
    replicas: list[ReplicaSpec] = []
    for entry in plan.models:
        if entry.name not in layout:
            raise PlannerError(f"{name}: model {entry.name!r} does not fit in its share; nothing to measure")
        count, batch = int(layout[entry.name]["replicas"]), int(layout[entry.name]["batch_size"])
        template = plan.replicas_of(entry.name)[0]
        for k in range(count):
            port = next(ports)
            fraction = math.floor(share / count * 10_000) / 10_000 if usable else None
            replicas.append(replace(template, name=f"{template.name.rsplit('-r', 1)[0]}-r{k}", port=port,
                                    max_num_seqs=batch, admission=replace(template.admission, max_requests=batch),
                                    gpu_memory_utilization=fraction))
    return replace(plan, replicas=tuple(replicas), validation={})


async def _embed(session: aiohttp.ClientSession, url: str, model: str, text: str,
                 timeouts: Timeouts) -> RequestResult:
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/embeddings", json={"model": model, "input": text},
                                timeout=timeouts.client_timeout()) as response:
            body = await response.read()
            if response.status != 200:
                return RequestResult(start, time.perf_counter(), error=f"HTTP {response.status}: {body[:200]!r}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return RequestResult(start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return RequestResult(start, end, ttft_s=end - start)


async def drive(url: str, models: tuple[ModelEntry, ...], config: MultiValidateConfig,
                builders: Mapping[str, PromptBuilder] | None = None) -> dict[str, list[RequestResult]]:
    """Every model's Poisson arrivals at its planned rate x scale, for the duration; each request's result.

    Prompts are built with each model's tokenizer where `builders` has one (exact lengths), else approximated."""
    approximate = ApproximatePrompts()
    rng = random.Random(config.seed)
    results: dict[str, list[RequestResult]] = {m.name: [] for m in models}
    tasks: list[asyncio.Task[None]] = []
    async with load_session() as session:
        async def one(entry: ModelEntry, index: int) -> None:
            traffic = entry.traffic
            text = (builders or {}).get(entry.name, approximate).build(int(traffic.get("input_tokens") or 16), index)
            if entry.kind == "embed":
                result = await _embed(session, url, entry.name, text, config.timeouts)
            else:
                spec = RequestSpec(text, int(traffic.get("output_tokens") or 16))
                result = await stream_completion(session, url, entry.name, spec, config.timeouts)
            results[entry.name].append(result)

        events = sorted((t, i, entry) for entry in models for i, t in enumerate(
            _arrivals(rng, float(entry.traffic.get("rate") or 1) * config.scale, config.duration_s)))
        start = time.perf_counter()
        for at, index, entry in events:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(entry, index)))
        await asyncio.gather(*tasks)
    return results


def _arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return times
        times.append(t)


def score(models: tuple[ModelEntry, ...], results: dict[str, list[RequestResult]],
          duration_s: float) -> dict[str, Any]:
    """Per model and in all: requests, failures, p99 TTFT, share within the goal; goodput (pure)."""
    per_model, met_all, sent_all = {}, 0, 0
    for entry in models:
        rows = results.get(entry.name, [])
        goal_s = (entry.slo.get("p99_ttft_ms") or math.inf) / 1000
        ttfts = sorted(r.ttft_s for r in rows if r.ok and r.ttft_s is not None)
        met = sum(1 for t in ttfts if t <= goal_s)
        p99 = ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] if ttfts else None
        per_model[entry.name] = {"requests": len(rows), "failed": sum(1 for r in rows if not r.ok),
                                 "p99_ttft_ms": None if p99 is None else round(1000 * p99, 1),
                                 "within_goal": round(met / len(rows), 4) if rows else None}
        met_all, sent_all = met_all + met, sent_all + len(rows)
    return {"models": per_model, "goodput_rps": round(met_all / duration_s, 3),
            "within_goal": round(met_all / sent_all, 4) if sent_all else None}


class MultiValidator:
    """Deploys each arrangement in turn and measures it under the same traffic."""

    def __init__(self, plan: Plan, config: MultiValidateConfig, deployer: Deployer,
                 out: Callable[[str], None] = print) -> None:
        if not plan.models:
            raise PlannerError("not a multi-model plan (no models: section)")
        self.plan, self.config, self.deployer, self.out = plan, config, deployer, out
        self.layouts = {name: arrangement(plan, name) for name in config.arrangements}  # fail before deploying
        self.builders = {m.name: prompt_builder(facts_source(plan.replicas_of(m.name)[0].model), None)
                         for m in plan.models}

    def run(self) -> Plan:
        measured = {}
        for name, layout in self.layouts.items():
            self.out(f"{name}: deploying {len(layout.replicas)} replica(s), then {self.config.duration_s:g} s of "
                     f"mixed traffic at {self.config.scale:g} x the planned rates")
            with self.deployer.deploy(layout, name) as url:
                results = asyncio.run(drive(url, layout.models, self.config, self.builders))
            row = score(layout.models, results, self.config.duration_s)
            row["replicas"] = {m.name: [(r.max_num_seqs, r.gpu_memory_utilization or r.cpu_kvcache_space_gib)
                                        for r in layout.replicas_of(m.name)] for m in layout.models}
            if all(v["requests"] == v["failed"] for v in row["models"].values()):
                raise RunError(f"{name}: every request failed")
            self.out(f"{name}: goodput {row['goodput_rps']} requests/s within goal ({row['within_goal']:.1%}); "
                     + ", ".join(f"{m} p99 TTFT {v['p99_ttft_ms']} ms" for m, v in row["models"].items()))
            measured[name] = row
        best = max(measured, key=lambda n: (measured[n]["goodput_rps"], n == "packed"))
        validation = {"kind": "multimodel", "scale": self.config.scale, "duration_s": self.config.duration_s,
                      "arrangements": measured, "best": best,
                      "rule": "the same seeded Poisson traffic per model through the gateway; goodput counts "
                              "requests within their model's p99 TTFT goal"}
        return replace(self.plan, validation=validation)
