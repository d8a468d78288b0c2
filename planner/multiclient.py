"""One closed-loop load driven by several client processes at once.

One Python process streaming every request of k x B* in flight can itself be the limit: on an H200 (docs/bench/gpu,
run 3), two OPT-1.3B replicas through the gateway measured +3% over one with `planner validate`'s one client and
+17% with one client process per replica, at 0.5 cores per client. So the requests are split between processes,
each a closed loop at its share of the concurrency; they start together (a barrier) and their results are joined
into one `LoadResult`, the times moved onto the wall clock so that one run's duration spans them all.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from planner.client import LoadResult, RequestResult, Timeouts, load_session, run_load
from planner.errors import RunError
from planner.workload import RequestSpec

START_TIMEOUT_S = 120.0  # for every process to start and reach the barrier


@dataclass(frozen=True)
class Share:
    """What one client process sends: its requests and how many it keeps in flight."""

    requests: tuple[RequestSpec, ...]
    concurrency: int


def split(requests: Sequence[RequestSpec], concurrency: int, processes: int) -> list[Share]:
    """The requests dealt in turn to at most `processes` shares (never more than the concurrency or the requests),
    the concurrency divided as evenly as it goes (pure)."""
    if concurrency < 1 or processes < 1:
        raise ValueError(f"concurrency and processes must be >= 1, got {concurrency} and {processes}")
    n = max(1, min(processes, concurrency, len(requests)))
    return [Share(tuple(requests[i::n]), concurrency // n + (1 if i < concurrency % n else 0)) for i in range(n)]


def on_wall_clock(results: Sequence[RequestResult], offset_s: float) -> tuple[RequestResult, ...]:
    """Results whose start and end were read from one process's `perf_counter`, moved by that process's
    wall-clock offset, so that results from several processes share one time axis (pure)."""
    return tuple(replace(r, start=r.start + offset_s, end=r.end + offset_s) for r in results)


def _client(index: int, url: str, model: str, share: Share, timeouts: Timeouts,
            barrier: Any, results: Any) -> None:
    """One client process: wait for the others, run its share, send back (index, offset, result with the CPU
    seconds it took, or an error)."""
    try:
        barrier.wait(timeout=START_TIMEOUT_S)
        offset, cpu = time.time() - time.perf_counter(), time.process_time()
        load = asyncio.run(_drive(url, model, share, timeouts))
        results.put((index, offset, replace(load, client_cpu_s=time.process_time() - cpu), None))
    except (OSError, RuntimeError, ValueError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        # RuntimeError covers threading.BrokenBarrierError: another process never reached the barrier
        results.put((index, 0.0, None, f"{type(exc).__name__}: {exc}"))


async def _drive(url: str, model: str, share: Share, timeouts: Timeouts) -> LoadResult:
    async with load_session() as session:
        return await run_load(session, url, model, share.requests, share.concurrency, timeouts)


def run_load_processes(url: str, model: str, requests: Sequence[RequestSpec], concurrency: int,
                       timeouts: Timeouts, processes: int) -> LoadResult:
    """`run_load` over `processes` client processes together: every request tried once, at most `concurrency`
    in flight in all. Raises `RunError` naming a process that failed or did not finish in time."""
    shares = split(requests, concurrency, processes)
    context = multiprocessing.get_context("spawn")  # a clean interpreter: no event loop or sockets inherited
    barrier, results = context.Barrier(len(shares)), context.Queue()
    # Each share's worst case: every one of its waves at the whole-request timeout, plus the start.
    limit_s = START_TIMEOUT_S + max(math.ceil(len(s.requests) / s.concurrency) for s in shares) * timeouts.request_s
    procs = [context.Process(target=_client, args=(i, url, model, share, timeouts, barrier, results),
                             name=f"client-{i}", daemon=True) for i, share in enumerate(shares)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + limit_s
    parts: dict[int, tuple[RequestResult, ...]] = {}
    cpu_s = 0.0
    try:
        while len(parts) < len(procs):
            try:
                index, offset, load, error = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RunError(f"client process(es) {', '.join(dead)} exited before reporting") from None
                if time.monotonic() > deadline:
                    raise RunError(f"the client processes did not finish within {limit_s:.0f} s") from None
                continue
            if error is not None:
                raise RunError(f"client process {index} failed: {error}")
            parts[index] = on_wall_clock(load.results, offset)
            cpu_s += load.client_cpu_s or 0.0
    finally:
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
    return LoadResult(tuple(r for i in sorted(parts) for r in parts[i]), concurrency, round(cpu_s, 3))
