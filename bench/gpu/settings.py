"""What `python -m bench.gpu_replication` measures and how long each step may take: one frozen value.

Two presets: `gpu` (the real experiment, sized for one model in a 25-minute GPU window, vLLM start-ups
included) and `quick` (the same pipeline on vLLM-CPU with the tiny model in a few minutes, for CI). The request
counts are sized from the time each point may take, not fixed: a point gets `waves` rounds of its concurrency,
at least what the last measured throughput serves in `min_point_s` (the first H200 run's points lasted 1-5 s, too
short for a steady rate or for /metrics to sample the engine), capped at what it serves in `point_s`, and never
less than one round.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

STEPS = ("frontier", "plan", "replicas", "mps", "report")


@dataclass(frozen=True)
class Settings:
    """One run of the benchmark."""

    model: str
    out: Path
    device: str = "gpu"  # gpu | cpu
    batch_sizes: tuple[int, ...] = (1, 16, 64, 128, 256, 512)
    input_tokens: int = 256
    output_tokens: int = 128
    waves: float = 6.0  # requests per point = waves x concurrency (the first round, the fill, is not steady) ...
    min_requests: int = 16  # ... at least this many ...
    min_point_s: float = 10.0  # ... at least what the last measured rate serves in this many seconds ...
    point_s: float = 25.0  # ... and at most what it serves in this many
    min_replicas: int = 2  # measure at least 1..2 replicas even if the plan keeps one (that is the question)
    max_replicas: int = 4
    loads: tuple[float, ...] = (0.6, 0.9, 1.2)  # Poisson rates as fractions of the single instance's capacity
    rate_duration_s: float = 20.0
    drain_s: float = 60.0
    policies: tuple[str, ...] = ("least_outstanding_tokens", "round_robin")
    gateway_workers: int | None = None  # None: the plan's count (1 for the single instance)
    direct: bool = True  # also drive 1..N replicas with one client process each, straight and through the gateway
    client_processes: int = 1  # processes that send each closed loop of the frontier and of each replica's client
    mps: bool = True
    min_gain: float = 0.05
    startup_timeout_s: float = 600.0
    vllm_args: tuple[str, ...] = ()
    cpu_kvcache_gib: float | None = None
    port: int = 18000  # the gateway; replicas on port+1..; the single instance on port+50
    gpu_index: int = 0
    window_s: float = 25 * 60
    startup_estimate_s: float = 60.0  # one vLLM start, for the time budget (the first one compiles longer)
    warmup_requests: int = 2
    prefill_reps: int = 5  # bench.prefill_cost's prompts per cell, on the frontier's idle instance
    request_timeout_s: float = 600.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in ("gpu", "cpu"):
            raise ValueError(f"device must be gpu or cpu, got {self.device!r}")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"batch sizes must be distinct positive integers, got {list(self.batch_sizes)}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= --min-replicas <= --max-replicas, got {self.min_replicas}, "
                             f"{self.max_replicas}")
        if not 0 <= self.min_point_s <= self.point_s:
            raise ValueError(f"need 0 <= min_point_s <= --point-s, got {self.min_point_s}, {self.point_s}")
        if not self.loads or min(self.loads) <= 0:
            raise ValueError(f"loads must be positive fractions of capacity, got {list(self.loads)}")
        for name in ("input_tokens", "output_tokens", "min_requests", "prefill_reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.client_processes < 1:
            raise ValueError(f"--client-processes must be >= 1, got {self.client_processes}")
        if self.gateway_workers is not None and self.gateway_workers < 1:
            raise ValueError(f"--gateway-workers must be >= 1, got {self.gateway_workers}")
        if not 0 < self.port <= 65535 - 100:
            raise ValueError(f"--port {self.port} leaves no room for the replicas' ports")

    def requests_for(self, concurrency: int, req_s: float | None) -> int:
        """Requests for a point at `concurrency` (see the module docstring)."""
        n = max(self.min_requests, math.ceil(self.waves * concurrency))
        if req_s:
            n = max(n, math.ceil(req_s * self.min_point_s))
            n = min(n, max(concurrency, self.min_requests, math.ceil(req_s * self.point_s)))
        return n

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["out"] = str(self.out)
        return data

    @property
    def single_port(self) -> int:
        return self.port + 50


def gpu_preset(model: str, out: Path) -> Settings:
    """Two client processes a closed loop: on run 4 (H200, Qwen3-1.7B, a token a chunk) one process at 100
    streams used 1.03 cores."""
    return Settings(model=model, out=out, client_processes=2)


def quick_preset(out: Path, model: str = "tiny") -> Settings:
    """vLLM-CPU with the tiny model: every step once, small; the numbers say nothing about GPUs."""
    return Settings(model=model, out=out, device="cpu", batch_sizes=(2, 8), input_tokens=32, output_tokens=16,
                    waves=2.0, min_requests=8, min_point_s=0.0, point_s=20.0, min_replicas=2, max_replicas=2,
                    loads=(0.9,), rate_duration_s=6.0, drain_s=60.0, mps=True, startup_timeout_s=300.0,
                    vllm_args=("--max-model-len", "512"), cpu_kvcache_gib=1.0, window_s=5 * 60,
                    startup_estimate_s=30.0, warmup_requests=1, request_timeout_s=120.0, prefill_reps=2)


def with_overrides(settings: Settings, **changes: Any) -> Settings:
    """The settings with the given fields changed (None values ignored)."""
    return replace(settings, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class StepBudget:
    """A step's planned cost: vLLM start-ups and measuring time (seconds)."""

    step: str
    starts: int
    measure_s: float
    what: str

    def total_s(self, startup_s: float) -> float:
        return self.starts * startup_s + self.measure_s


def budget(settings: Settings, replicas: int | None = None) -> list[StepBudget]:
    """What each step will do and take, before anything is measured (replicas: the plan's count, if known)."""
    n = replicas or settings.max_replicas
    rate_s = settings.rate_duration_s + 15.0  # Locust's start and the drain of the last requests
    frontier = sum(max(settings.min_point_s, min(settings.point_s, 4.0 + 0.03 * b)) + 3.0
                   for b in settings.batch_sizes)
    counts = n * (settings.point_s * 0.6 + 5.0) * (3 if settings.direct else 1)
    routing = len(settings.policies) * len(settings.loads) * rate_s
    steps = [
        StepBudget("frontier", 1, frontier + 10.0 + len(settings.loads) * rate_s,
                   f"one instance (max_num_seqs {max(settings.batch_sizes)}), batch caps "
                   f"{', '.join(map(str, settings.batch_sizes))} in closed loop; what a prefill costs by the "
                   f"cached context it attends to (bench.prefill_cost, {settings.prefill_reps} prompts a cell, "
                   f"the instance idle); then the baseline at its best cap through the gateway at "
                   f"{len(settings.loads)} Poisson rate(s)"),
        StepBudget("plan", 0, 1.0, "planner plan on the frontier: B*, replicas, memory each"),
        StepBudget("replicas", n, counts + routing,
                   f"{n} replicas at B*: 1..{n} of them through the gateway in closed loop (Fig. 5, no MPS)"
                   + (", and by one client process per replica, through the gateway and straight; "
                      if settings.direct else "; ") +
                   f"then {' and '.join(settings.policies)} at {len(settings.loads)} Poisson rate(s) "
                   f"of {settings.rate_duration_s:g} s (Figs. 4, 6, 7)"),
    ]
    if settings.mps and settings.device == "gpu":
        steps.append(StepBudget("mps", n, counts, f"the same {n} replicas under NVIDIA MPS: 1..{n} in closed loop"))
    steps.append(StepBudget("report", 0, 35.0, "plots and summary.md beside the papers' figures; the simulator "
                            "calibrated from the frontier (sim calibrate: about 30 s)"))
    return steps
