"""`planner profile`: sweep the batch cap B over one replica, one JSON file per point.

For each B (ascending): skip it if its point file exists; otherwise get a replica capped at B (launched with
`--max-num-seqs B`, or the running one), warm it up, then run the workload with B requests in flight while
`/metrics` is scraped (peak KV usage, preemptions, KV pool) and NVML is sampled (when there is a GPU), and
write the point. A replica that fails ends the sweep; the points already written stay and a rerun resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from deploy.process import ProcessError
from planner.client import LoadResult, RequestResult, Timeouts, load_session, run_load, served_model
from planner.errors import PlannerError, RunError
from planner.gpu import GpuSampler
from planner.multiclient import run_load_processes
from planner.points import GpuSummary, ProfileContext, ProfilePoint
from planner.servers import ServerProvider
from planner.sources import point_path, read_point, write_point
from planner.stats import summarize
from planner.vllm_metrics import MetricsWatcher
from planner.workload import RequestSpec, WorkloadSource

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WARMUP_OFFSET = 10**9  # prompt indices: 10**6 per B, its warm-up this far on, so no prompt repeats across points
SEED_STRIDE = 10**10  # ... and another prompt seed starts this far on: no prompt of one seed's profile in another's


def default_num_requests(batch_size: int) -> int:
    """Four waves of B requests, at least 32: enough to reach steady state at every B."""
    return max(32, 4 * batch_size)


@dataclass(frozen=True)
class ProfileConfig:
    """How to sweep."""

    out: Path
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    num_requests: int | None = None  # None: default_num_requests(B)
    warmup_requests: int | None = None  # None: one round at the point's batch size (see `warmup_for`)
    model_name: str | None = None  # the name requests carry; None: the replica's first /v1/models entry
    metrics_interval_s: float = 0.5
    progress_interval_s: float = 5.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    dry_run: bool = False
    prompt_seed: int = 0  # another seed, other prompts: a replica profiled again finds none in its prefix cache
    client_processes: int = 1  # >1: each point's load from that many child processes (planner.multiclient)

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise PlannerError(f"batch sizes must be positive integers, got {list(self.batch_sizes)}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise PlannerError(f"batch sizes are listed twice: {list(self.batch_sizes)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise PlannerError(f"--num-requests must be >= 1, got {self.num_requests}")
        if (self.warmup_requests is not None and self.warmup_requests < 0) or self.metrics_interval_s <= 0:
            raise PlannerError("--warmup must be >= 0 and --metrics-interval > 0")
        if self.prompt_seed < 0:
            raise PlannerError(f"--prompt-seed must be >= 0, got {self.prompt_seed}")
        if self.client_processes < 1:
            raise PlannerError(f"--client-processes must be >= 1, got {self.client_processes}")

    def warmup_for(self, batch_size: int) -> int:
        """Warm-up requests before the point at `batch_size`: as configured, else one round of `batch_size` sent
        together. A vLLM-CPU replica just started took 401 ms to prefill its first round of 16 prompts of 256 tokens
        and 231-242 ms for each round after it (`bench.round_probe`, docs/sim.md); a warm-up of 2 requests left that
        first round in the point."""
        return batch_size if self.warmup_requests is None else self.warmup_requests

    def requests_for(self, batch_size: int) -> int:
        return self.num_requests or default_num_requests(batch_size)


class Progress:
    """Prints a line per point and, while one runs, every `interval_s` how far it got."""

    def __init__(self, out: Callable[[str], None], batch_size: int, total: int, interval_s: float) -> None:
        self._out, self._batch, self._total, self._interval = out, batch_size, total, interval_s
        self._start = self._last = time.monotonic()
        self.done = self.failed = self.tokens = 0

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        self.tokens += result.output_tokens
        now = time.monotonic()
        if now - self._last >= self._interval and self.done < self._total:
            self._last = now
            self._out(f"  B={self._batch}: {self.done}/{self._total} requests, {self.failed} failed, "
                      f"{self.tokens / (now - self._start):.0f} output tok/s so far")


class Profiler:
    """Runs the sweep; the replica source, the workload and the GPU sampler are given (tests pass fakes)."""

    def __init__(self, config: ProfileConfig, servers: ServerProvider, workload: WorkloadSource,
                 context: ProfileContext, gpu: GpuSampler | None = None,
                 out: Callable[[str], None] = print) -> None:
        self.config, self.servers, self.workload = config, servers, workload
        self.context, self.gpu, self.out = context, gpu, out

    def run(self) -> list[Path]:
        """Measure every point not yet on disk; return the point files (all of them, old and new)."""
        todo = self._plan_sweep()
        if self.config.dry_run:
            return []
        for batch in todo:
            self._point(batch)
        return [point_path(self.config.out, b) for b in sorted(self.config.batch_sizes)
                if point_path(self.config.out, b).exists()]

    def _plan_sweep(self) -> list[int]:
        todo = []
        for batch in sorted(self.config.batch_sizes):
            path = point_path(self.config.out, batch)
            n = self.config.requests_for(batch)
            if path.exists():
                self._check_same_run(path)
                self.out(f"B={batch}: done already ({path}), skipped")
            elif self.config.dry_run:
                self.out(f"B={batch}: would {self.servers.describe(batch)}; then send {n} requests, {batch} at a "
                         f"time ({self.workload.describe().kind} workload) and write {path}")
            else:
                todo.append(batch)
        return todo

    def _check_same_run(self, path: Path) -> None:
        """A point on disk is reused only if it measured the same model, device and workload."""
        done, _ = read_point(path)
        ours = self.context
        if (done.model, done.device, done.workload) != (ours.model, ours.device, ours.workload):
            raise PlannerError(f"{path} was measured with another model, device or workload "
                               f"({done.model}, {done.device}, {done.workload}); give this run another --out")

    def _point(self, batch: int) -> None:
        n = self.config.requests_for(batch)
        self.out(f"B={batch}: {'starting vLLM, then ' if self.servers.launches else ''}{n} requests, "
                 f"{batch} at a time")
        if self.gpu is not None and self.servers.launches:
            self.gpu.mark_baseline()
        try:
            with self.servers.serve(batch) as url:
                point = asyncio.run(self.measure(url, batch))
        except ProcessError as exc:
            raise RunError(f"B={batch}: the replica failed: {exc}\nThe points already measured are kept in "
                           f"{self.config.out}; a rerun resumes from here.") from exc
        path = write_point(self.config.out, self.context, point)
        self.out(f"B={batch}: {point.total_tok_s:.0f} tok/s total, {point.req_s} req/s, p99 TPOT "
                 f"{point.tpot_ms.p99} ms, p99 TTFT {point.ttft_ms.p99} ms, peak KV "
                 f"{_pct(point.peak_kv_usage)}, preemptions {point.preemptions}, running "
                 f"{'n/a' if point.mean_running is None else f'{point.mean_running:.1f}'} on average "
                 f"({point.metrics_missed} /metrics scrapes unanswered), {self.config.client_processes} client "
                 f"process(es) {'n/a' if point.client_cores is None else f'{point.client_cores:.2f}'} cores -> {path}")

    async def measure(self, url: str, batch: int) -> ProfilePoint:
        """One point against a replica at `url`: warm up, run, scrape, sample."""
        n = self.config.requests_for(batch)
        timeouts = self.config.timeouts
        seed = self.config.prompt_seed * SEED_STRIDE
        async with load_session() as session:
            model = self.config.model_name or await served_model(session, url)
            first = seed + batch * 10**6  # the point's first prompt index
            warmup = self.config.warmup_for(batch)
            if warmup:
                warm = self.workload.requests(warmup, WARMUP_OFFSET + first)
                await run_load(session, url, model, warm, batch, timeouts)
            requests = self.workload.requests(n, first)
            progress = Progress(self.out, batch, n, self.config.progress_interval_s)
            async with MetricsWatcher(session, url, self.config.metrics_interval_s) as watcher:
                load, gpu = await self._run_sampled(session, url, model, requests, batch, progress)
        return self._to_point(batch, load, watcher, gpu)

    async def _run_sampled(self, session: aiohttp.ClientSession, url: str, model: str,
                           requests: Sequence[RequestSpec], batch: int,
                           progress: Progress) -> tuple[LoadResult, GpuSummary | None]:
        if self.gpu is None:
            return await self._load(session, url, model, requests, batch, progress), None
        self.gpu.start()
        try:
            load = await self._load(session, url, model, requests, batch, progress)
        finally:
            summary = self.gpu.stop()
        return load, summary

    async def _load(self, session: aiohttp.ClientSession, url: str, model: str, requests: Sequence[RequestSpec],
                    batch: int, progress: Progress) -> LoadResult:
        """The point's load, with the CPU the client spent on it: this process's, or its client processes' (in a
        thread, so that this loop keeps scraping /metrics meanwhile). One process streaming every token can be
        the limit: on an H200, one at 100 Qwen3-1.7B streams used 1.03 cores."""
        processes = self.config.client_processes
        if processes > 1:
            return await asyncio.to_thread(run_load_processes, url, model, requests, batch, self.config.timeouts,
                                           processes)
        cpu = time.process_time()
        load = await run_load(session, url, model, requests, batch, self.config.timeouts, progress)
        return replace(load, client_cpu_s=time.process_time() - cpu)

    def _to_point(self, batch: int, load: LoadResult, watcher: MetricsWatcher,
                  gpu: GpuSummary | None) -> ProfilePoint:
        s = summarize(load)
        if s.failed_requests == s.num_requests:
            errors = sorted({r.error for r in load.results if r.error})
            raise RunError(f"B={batch}: all {s.num_requests} requests failed, e.g. {errors[:3]}")
        if s.failed_requests:
            logger.warning("B=%d: %d of %d requests failed", batch, s.failed_requests, s.num_requests)
        return ProfilePoint(batch_size=batch, total_tok_s=s.total_tok_s, output_tok_s=s.output_tok_s, req_s=s.req_s,
                            ttft_ms=s.ttft_ms, tpot_ms=s.tpot_ms, itl_ms=s.itl_ms, e2e_ms=s.e2e_ms,
                            preemptions=watcher.preemptions, peak_kv_usage=watcher.peak_kv_usage,
                            mean_running=watcher.mean_running, metrics_missed=watcher.missed,
                            kv_pool=watcher.kv_pool, gpu=gpu, num_requests=s.num_requests,
                            failed_requests=s.failed_requests, duration_s=s.duration_s,
                            steady_tok_s=s.steady_tok_s, steady_s=s.steady_s, client_cores=s.client_cores)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2%}"
