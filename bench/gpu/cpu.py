"""How many CPU cores each process of a measurement used: the gateway, vLLM's API servers, its engine cores.

A vLLM replica is an API server process (HTTP, tokenizing, streaming) with its engine core as a child; on a fast
GPU the API server can be the limit (docs/bench/gpu/README.md), and a gateway in front of it another. `CpuMeter`
reads each process tree's CPU time when a measurement starts and ends: cores = CPU seconds / wall seconds. A child
that exits in between takes its time with it; the processes measured here live throughout.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import psutil

from bench.gateway_overhead import cpu_seconds


def tree_cpu_seconds(pid: int, children: bool) -> float:
    """CPU seconds of `pid` alone, or of its descendants alone (0 for a process that is gone); each process read
    by `bench.gateway_overhead.cpu_seconds`, every thread."""
    try:
        procs = psutil.Process(pid).children(recursive=True) if children else [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            total += cpu_seconds(p.pid)
        except FileNotFoundError:  # ended meanwhile
            continue
    return total


class CpuMeter:
    """Cores used per group between `start` and `stop`. `groups` maps a name to (pid, children): the process
    itself (children False: a vLLM API server) or everything under it (True: its engine core; a gateway's
    workers under their supervisor). Several pids of one group add up."""

    def __init__(self, groups: Mapping[str, list[tuple[int, bool]]]) -> None:
        self._groups = {name: list(members) for name, members in groups.items() if members}
        self._start: dict[str, float] = {}
        self._started_at = 0.0

    def _read(self) -> dict[str, float]:
        return {name: sum(tree_cpu_seconds(pid, children) for pid, children in members)
                for name, members in self._groups.items()}

    def start(self) -> None:
        self._start, self._started_at = self._read(), time.monotonic()

    def stop(self) -> dict[str, float]:
        """Cores used per group since `start` (rounded to 0.01)."""
        wall = max(time.monotonic() - self._started_at, 1e-9)
        end = self._read()
        return {name: round((end[name] - self._start.get(name, 0.0)) / wall, 2) for name in end}
