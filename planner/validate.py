"""`planner validate`: deploy 1, 2, ... N replicas of the plan, drive the same workload through the gateway,
measure total throughput and latency for each count, keep the best, and write the comparison into the plan.

Each count runs as `deploy up --plan <the plan cut to k replicas>` in its own process group (deploy starts the
replicas one after another, then the gateway) and is measured once the gateway's `/ready` answers. The load is
k x B* requests in flight, so every replica can fill its batch cap, sent by one client process per replica
(`--clients`: one Python process streaming them all can be the limit on a fast GPU; planner/multiclient.py).
The best count is the smallest whose throughput is within `min_gain` of the highest: more replicas that add
less than that are not worth their memory (the papers: +35% for two replicas of OPT-1.3B, nothing more for four).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from deploy.plan import Plan, dump
from deploy.process import ManagedProcess, ProcessError
from planner.client import Timeouts, load_session, run_load, served_model
from planner.errors import PlannerError, RunError
from planner.multiclient import run_load_processes
from planner.stats import RunSummary, summarize
from planner.workload import WorkloadSource

logger = logging.getLogger(__name__)


class Deployer(Protocol):
    """Runs a plan for the duration of a `with` block, yielding the gateway's base URL once it is ready."""

    def deploy(self, plan: Plan, label: str) -> contextlib.AbstractContextManager[str]: ...


@dataclass(frozen=True)
class SubprocessDeployer:
    """`deploy up --plan FILE` as a subprocess, ready when the gateway's /ready answers 200."""

    run_dir: Path
    startup_timeout_s: float = 900.0
    python: str = sys.executable

    @contextlib.contextmanager
    def deploy(self, plan: Plan, label: str) -> Iterator[str]:
        directory = self.run_dir / label
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "plan.yaml"
        dump(plan, path)
        url = f"http://127.0.0.1:{plan.gateway.port}"
        argv = [self.python, "-m", "deploy.cli", "up", "--plan", str(path), "--run-dir", str(directory),
                "--startup-timeout", str(self.startup_timeout_s)]
        n = len(plan.replicas)
        # deploy stops its replicas (each in its own process group) on SIGTERM: give it time to, before SIGKILL.
        with ManagedProcess(f"deploy ({label})", argv, directory / "deploy.log", f"{url}/ready",
                            startup_timeout_s=self.startup_timeout_s * n + 120, stop_grace_s=30.0 * (n + 1)):
            yield url


@dataclass(frozen=True)
class ValidateConfig:
    """What to measure."""

    counts: tuple[int, ...]
    num_requests: int | None = None  # None: 4 x k x B*, at least 32
    min_gain: float = 0.05
    warmup_requests: int = 2
    timeouts: Timeouts = field(default_factory=Timeouts)
    clients: int = 0  # client processes per count; 0: one per replica (planner/multiclient.py says why)

    def __post_init__(self) -> None:
        if not self.counts or min(self.counts) < 1:
            raise PlannerError(f"replica counts must be positive, got {list(self.counts)}")
        if not 0 <= self.min_gain < 1:
            raise PlannerError(f"--min-gain must be in [0, 1), got {self.min_gain!r}")
        if self.num_requests is not None and self.num_requests < 1:
            raise PlannerError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.clients < 0:
            raise PlannerError(f"--clients must be >= 0 (0: one client process per replica), got {self.clients}")

    def processes(self, replicas: int) -> int:
        """Client processes that drive a count of `replicas`."""
        return self.clients or replicas


@dataclass(frozen=True)
class CountResult:
    """One replica count, measured through the gateway."""

    replicas: int
    concurrency: int
    summary: RunSummary

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "concurrency": self.concurrency, **asdict(self.summary)}


def best_count(results: list[CountResult], min_gain: float) -> CountResult:
    """The smallest count whose total tokens/s is within `min_gain` of the highest (pure)."""
    best = best_of(rates_of(results), min_gain)
    return next(r for r in results if r.replicas == best)


def explain_best(results: list[CountResult], best: CountResult, min_gain: float) -> str:
    """Why `best` was kept, in a sentence (pure); says so plainly when replication does not pay."""
    return explain(rates_of(results), best.replicas, min_gain)


def rates_of(results: list[CountResult]) -> dict[int, float]:
    return {r.replicas: r.summary.total_tok_s for r in results}


def best_of(rates: dict[int, float], min_gain: float) -> int:
    """Of replica count -> total tokens/s, the smallest count within `min_gain` of the highest (pure)."""
    top = max(rates.values())
    return min(k for k, tok_s in rates.items() if tok_s >= (1 - min_gain) * top)


def explain(rates: dict[int, float], best: int, min_gain: float) -> str:
    """Why count `best` was kept of replica count -> total tokens/s, in a sentence (pure)."""
    ordered = sorted(rates)
    fewest, top = ordered[0], max(ordered, key=lambda k: rates[k])
    base = rates[fewest]

    def gain(k: int) -> str:
        return f"{rates[k] / base - 1:+.1%}" if base else "n/a"

    if len(ordered) == 1:
        return f"keep {best} replica(s): the only count measured ({base:.0f} tokens/s)"
    if best == fewest:
        others = ", ".join(f"{k} replicas {gain(k)}" for k in ordered[1:])
        return (f"keep {best} replica(s): replication does not pay here. Over {fewest} "
                f"({base:.0f} tokens/s), {others}: less than the {min_gain:.0%} it takes to be worth another "
                "replica's memory")
    if best == top:
        return (f"keep {best} replicas: the highest throughput, {rates[best]:.0f} tokens/s, "
                f"{gain(best)} over {fewest}")
    return (f"keep {best} replicas ({gain(best)} over {fewest}): {top} gave "
            f"{rates[top]:.0f} tokens/s, within {min_gain:.0%} of it, not worth the extra memory")


def sub_plan(plan: Plan, count: int) -> Plan:
    """The plan cut to its first `count` replicas (each keeps its memory share and batch cap)."""
    if not 1 <= count <= len(plan.replicas):
        raise PlannerError(f"replica count {count} is outside 1..{len(plan.replicas)} (the plan's replicas)")
    return replace(plan, replicas=plan.replicas[:count], validation={})


class Validator:
    """Measures each count; the deployer and the workload are given (tests pass fakes)."""

    def __init__(self, plan: Plan, config: ValidateConfig, deployer: Deployer, workload: WorkloadSource,
                 out: Callable[[str], None] = print) -> None:
        self.plan, self.config, self.deployer, self.workload, self.out = plan, config, deployer, workload, out
        for count in config.counts:
            sub_plan(plan, count)  # fail on a bad count before deploying anything

    def batch_cap(self) -> int:
        caps = [r.admission.max_requests or r.max_num_seqs for r in self.plan.replicas]
        if any(c is None for c in caps):
            raise PlannerError("the plan's replicas need max_num_seqs (or an admission cap) to size the load")
        return max(c for c in caps if c is not None)

    def run(self) -> tuple[Plan, list[CountResult]]:
        """Measure every count; return the plan with the best count kept and the comparison written in."""
        results = [self.measure(count) for count in sorted(self.config.counts)]
        best = best_count(results, self.config.min_gain)
        base = results[0].summary.total_tok_s
        table = [{**r.to_dict(), "gain_vs_fewest": round(r.summary.total_tok_s / base - 1, 4) if base else None}
                 for r in results]
        validation = {
            "rule": f"keep the smallest replica count within {self.config.min_gain:.0%} of the highest total "
                    "tokens/s, measured through the gateway with k x B* requests in flight",
            "client_processes": {r.replicas: self.config.processes(r.replicas) for r in results},
            "best_replicas": best.replicas, "planned_replicas": len(self.plan.replicas),
            "decision": explain_best(results, best, self.config.min_gain),
            "workload": asdict(self.workload.describe()), "counts": table}
        kept = replace(self.plan, replicas=self.plan.replicas[:best.replicas], validation=validation)
        return kept, results

    def measure(self, count: int) -> CountResult:
        concurrency = count * self.batch_cap()
        n = self.config.num_requests or max(32, 4 * concurrency)
        self.out(f"{count} replica(s): deploying, then {n} requests, {concurrency} at a time through the gateway")
        try:
            with self.deployer.deploy(sub_plan(self.plan, count), f"replicas-{count}") as url:
                summary = self._drive(url, n, concurrency, self.config.processes(count))
        except ProcessError as exc:
            raise RunError(f"{count} replica(s): the deployment failed: {exc}") from exc
        if summary.failed_requests == summary.num_requests:
            raise RunError(f"{count} replica(s): all {summary.num_requests} requests failed")
        self.out(f"{count} replica(s): {summary.total_tok_s:.0f} tok/s total, {summary.req_s} req/s, p99 TTFT "
                 f"{summary.ttft_ms.p99} ms, p99 TPOT {summary.tpot_ms.p99} ms, {summary.failed_requests} failed")
        return CountResult(count, concurrency, summary)

    def _drive(self, url: str, n: int, concurrency: int, processes: int) -> RunSummary:
        """Warm up from this process, then the measured requests from `processes` client processes: never from
        this one, so that every count is driven alike, whatever else this process runs (a GPU sampler)."""
        model = asyncio.run(self._warm_up(url, concurrency))
        requests = self.workload.requests(n, concurrency * 10**6)
        return summarize(run_load_processes(url, model, requests, concurrency, self.config.timeouts, processes))

    async def _warm_up(self, url: str, concurrency: int) -> str:
        """The served model's name, after the warm-up requests."""
        async with load_session() as session:
            model = await served_model(session, url)
            if self.config.warmup_requests:
                warm = self.workload.requests(self.config.warmup_requests, 10**9)
                await run_load(session, url, model, warm, concurrency, self.config.timeouts)
            return model
