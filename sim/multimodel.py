"""Several models' replicas on one simulated GPU, each model with its own Poisson traffic, in virtual time.

Each replica is a simulated vLLM engine (`sim.engine`) sized as `deploy` sizes it from a plan (its model, its
`max_num_seqs`, its `gpu_memory_utilization`); all engines share one `SharedDevice`, so one model's decode steps
slow the others' as they would on the GPU. A request goes to the replica of its model with the fewest requests
running and waiting (what the gateway's load-aware policies approximate). An embedding request is a prefill with
one sampled token (vLLM's pooling pass has no decode). Pure apart from the virtual clock: same seed, same result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .clock import VirtualClock
from .device import SharedDevice
from .engine import Engine, EngineConfig, SimRequest
from .gpus import GpuSpec
from .memory import num_gpu_blocks
from .model import ModelSpec
from .steptime import StepTimeModel


@dataclass(frozen=True)
class ModelLoad:
    """One model on the GPU: its replicas' settings, its traffic and its goal."""

    name: str
    model: ModelSpec
    replicas: int
    max_num_seqs: int
    utilization: float  # per replica
    rate: float  # requests/s
    input_tokens: int
    output_tokens: int  # 0: an embedding model
    ttft_goal_s: float


@dataclass(frozen=True)
class ModelResult:
    """What one model's requests saw."""

    name: str
    requests: int
    p99_ttft_s: float
    within_goal: float  # share of its requests whose TTFT met its goal (unfinished ones count as missed)
    goodput_rps: float  # requests/s that met the goal


def _engines(load: ModelLoad, gpu: GpuSpec, device: SharedDevice, clock: VirtualClock) -> list[Engine]:
    max_len = max(load.model.max_model_len, load.input_tokens + max(load.output_tokens, 1))
    config = EngineConfig(num_gpu_blocks=num_gpu_blocks(load.model, gpu, load.utilization, load.max_num_seqs),
                          max_num_seqs=load.max_num_seqs, max_num_batched_tokens=max(max_len, 2048),
                          max_model_len=max_len)
    steps = StepTimeModel(load.model, gpu)
    return [Engine(config, steps, device, clock, f"{load.name}-{i}") for i in range(load.replicas)]


def simulate(loads: Sequence[ModelLoad], gpu: GpuSpec, duration_s: float = 60.0, seed: int = 0,
             drain_s: float = 30.0) -> list[ModelResult]:
    """Run every model's traffic for `duration_s` on one GPU; measure each model's TTFT against its goal."""
    clock = VirtualClock()
    device = SharedDevice(clock)
    rng = np.random.default_rng(seed)
    sent: dict[int, tuple[int, float]] = {}
    firsts: dict[int, float] = {}
    pools = [_engines(load, gpu, device, clock) for load in loads]

    def arrive(index: int) -> None:
        load = loads[index]
        engine = min(pools[index], key=lambda e: e.num_running + e.num_waiting)
        req = SimRequest(load.input_tokens, max(load.output_tokens, 1), on_first_token=first)
        sent[req.rid] = (index, clock.now())
        engine.add(req)

    def first(req: SimRequest) -> None:
        firsts[req.rid] = clock.now()

    for index, load in enumerate(loads):
        t = 0.0
        while True:
            t += rng.exponential(1 / load.rate)
            if t >= duration_s:
                break
            clock.call_at(t, arrive, index)
    clock.run(until=duration_s + drain_s)
    results = []
    for index, load in enumerate(loads):
        ttfts = np.array([firsts.get(rid, np.inf) - t for rid, (i, t) in sent.items() if i == index])
        met = int(np.sum(ttfts <= load.ttft_goal_s))
        ordered = np.sort(ttfts)  # unfinished requests are inf: the nearest-rank p99, no interpolation with inf
        p99 = float(ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]) if len(ordered) else 0.0
        results.append(ModelResult(load.name, len(ttfts), p99, met / len(ttfts) if len(ttfts) else 1.0,
                                   met / duration_s))
    return results
