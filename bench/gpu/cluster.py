"""Replicas and gateways for the benchmark, made of deploy's own parts.

`deploy up` starts replicas and one gateway together; the benchmark needs N replicas started once and gateways
over the first k of them, one policy at a time, so it uses the same pieces directly: model resolution
(`with_models`, `fit_to_hardware`), per-replica environments and CPU pinning (`launches`), the MPS daemon
(`MpsDaemon`), process groups with readiness waits (`VllmServer`) and the gateway's config and process
(`gateway_process`). Replicas start one after another, as `deploy up` starts them (vLLM sizes its KV cache
from the memory it finds free, so concurrent start-ups on one GPU would see each other's allocations).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.gpu.cpu import CpuMeter
from deploy.hardware import Hardware
from deploy.launch import fit_to_hardware, launches, with_models
from deploy.models import ResolvedModel, resolve
from deploy.mps import MpsDaemon
from deploy.plan import Admission, Plan
from deploy.process import VllmServer, probe
from deploy.up import UpConfig, gateway_process
from planner.gpu import GpuSampler
from planner.points import GpuSummary

logger = logging.getLogger(__name__)


def resolve_plan(plan: Plan, hardware: Hardware) -> tuple[Plan, dict[str, ResolvedModel]]:
    """The plan with every model resolved to what vLLM loads, and the flags and memory this device needs."""
    resolved = {name: resolve(name) for name in dict.fromkeys(r.model for r in plan.replicas)}
    return fit_to_hardware(with_models(plan, resolved, gpu=bool(hardware.gpus)), hardware), resolved


@dataclass
class Running:
    """Replicas that are up: their URLs, whether MPS runs under them, and how long they took to start."""

    urls: list[str] = field(default_factory=list)
    mps: bool = False
    startup_s: list[float] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # each replica's API server; its engine core is a child


def cpu_meter(replica_pids: list[int], gateway_pid: int | None = None, bench_pid: int | None = None) -> CpuMeter:
    """Cores used by the gateway (its supervisor and workers), the replicas' API servers and engine cores, and
    the benchmark's own process (where `planner validate`'s client runs, beside the GPU sampler)."""
    return CpuMeter({"gateway": [] if gateway_pid is None else [(gateway_pid, False), (gateway_pid, True)],
                     "api_servers": [(pid, False) for pid in replica_pids],
                     "engines": [(pid, True) for pid in replica_pids],
                     "bench_process": [] if bench_pid is None else [(bench_pid, False)]})


@contextlib.contextmanager
def replicas(plan: Plan, hardware: Hardware, run_dir: Path, *, mps: bool = False, startup_timeout_s: float = 600.0,
             log: Callable[[str], None] = print) -> Iterator[Running]:
    """Start the (resolved) plan's replicas (on a GPU one after another), under MPS if asked; all stopped on exit."""
    running = Running()
    with contextlib.ExitStack() as stack:
        extra: dict[str, str] = {}
        if mps:
            daemon = stack.enter_context(MpsDaemon(run_dir))
            running.mps = daemon.started
            extra = daemon.env()
            if not daemon.started:
                yield running  # the caller records that MPS could not run; nothing else is started
                return
        starting: list[tuple[str, VllmServer, float]] = []
        for launch in launches(plan, hardware, extra):
            log(f"  starting {launch.spec.name} on port {launch.spec.port} "
                f"({'MPS, ' if running.mps else ''}max_num_seqs {launch.spec.max_num_seqs})")
            server = VllmServer(launch.spec, run_dir / "logs" / f"{launch.spec.name}.log",
                                {**os.environ, **launch.env}, startup_timeout_s=startup_timeout_s)
            stack.callback(server.stop)
            server.start()
            starting.append((launch.spec.name, server, time.monotonic()))
            if hardware.starts_one_at_a_time:  # as `deploy up` starts them
                healthy(running, *starting.pop(), log)
        for name, server, started in starting:
            healthy(running, name, server, started, log)
        yield running


def healthy(running: Running, name: str, server: VllmServer, started: float, log: Callable[[str], None]) -> None:
    """Wait for a started replica to answer /health; record it and how long it took from its own start."""
    server.wait_ready()
    running.urls.append(server.url)
    if server.pid is not None:
        running.pids.append(server.pid)
    running.startup_s.append(round(time.monotonic() - started, 1))
    log(f"  {name} healthy after {running.startup_s[-1]:.0f} s")


@contextlib.contextmanager
def gateway(plan: Plan, hardware: Hardware, run_dir: Path, count: int, policy: str, port: int,
            batch_cap: int | None = None, workers: int | None = None,
            pids: list[int] | None = None) -> Iterator[str]:
    """The gateway over the plan's first `count` replicas with `policy` and `workers` processes (default: the
    plan's); its URL once /ready answers (and its process id appended to `pids`, if given)."""
    chosen = plan.replicas[:count]
    if batch_cap is not None:
        chosen = tuple(replace(r, admission=Admission(max_requests=batch_cap)) for r in chosen)
    spec = replace(plan.gateway, port=port, policy=policy, workers=workers or plan.gateway.workers)
    sub = replace(plan, replicas=chosen, gateway=spec, validation={})
    run_dir.mkdir(parents=True, exist_ok=True)
    config = UpConfig(plan=sub, launches=(), hardware=hardware, run_dir=run_dir, model_label=plan.model,
                      host="127.0.0.1", log_level="warning")
    proc, url = gateway_process(config, dict(os.environ))
    with proc:
        if pids is not None and proc.pid is not None:
            pids.append(proc.pid)
        deadline = time.monotonic() + 30.0
        while not probe(f"{url}/ready", 1.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {url} has no healthy replica after 30 s; see {run_dir}/logs")
            time.sleep(0.2)
        yield url


@dataclass
class SampledDeployer:
    """`planner validate`'s Deployer over replicas already running: a gateway over the first k, GPU sampled
    while the count is measured."""

    plan: Plan
    hardware: Hardware
    run_dir: Path
    port: int
    policy: str = "least_outstanding_tokens"
    sampler: GpuSampler | None = None
    workers: int | None = None
    replica_pids: list[int] = field(default_factory=list)
    last_cpu: dict[str, float] | None = None
    last_gpu: GpuSummary | None = None

    @contextlib.contextmanager
    def deploy(self, plan: Plan, label: str) -> Iterator[str]:
        pids: list[int] = []
        with gateway(self.plan, self.hardware, self.run_dir / label, len(plan.replicas), self.policy,
                     self.port, workers=self.workers, pids=pids) as url:
            meter = cpu_meter(self.replica_pids[:len(plan.replicas)], pids[0] if pids else None, os.getpid())
            meter.start()
            if self.sampler is not None:
                self.sampler.start()
            try:
                yield url
            finally:
                self.last_gpu = self.sampler.stop() if self.sampler is not None else None
                self.last_cpu = meter.stop()
