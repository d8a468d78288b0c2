"""One GPU shared by the replicas on it: their device work time-shares it; their host work overlaps.

Each replica's step submits its device part (seconds of work on an otherwise idle GPU). While k replicas have
device work outstanding, each progresses at 1/k speed (processor sharing: under MPS or time-slicing, memory-bound
kernels of several processes split the memory bandwidth). The host parts do not appear here: a replica's host
part runs while the GPU serves the others, and that overlap is what replication buys.

Processor sharing is kept in "virtual work" time: the work clock V advances at 1/k per second while k jobs are
active, a job submitted at V0 with w seconds of work finishes when V reaches V0 + w, and jobs finish in order of
that tag (a heap), so an event costs O(log k) rather than a pass over every job.

On a CPU replica the "device" is the replica's own core, and its API server may share it (`frontend_on_core`):
the front end's work then comes first (`block`): no job progresses while it runs. The API server mostly waits on
sockets, and Linux lets a task that wakes from sleep run ahead of one that has been running; against vLLM-CPU
under bursts this fitted better than sharing the core half and half (docs/sim.md, "Bursty arrivals").
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from .clock import Clock

_EPS = 1e-12  # seconds of work: a job this close to done is done (float rounding)


class SharedDevice:
    """A GPU whose device time the submitted jobs share equally."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._jobs: list[tuple[float, int, Callable[[], None]]] = []  # (finish tag, order, callback)
        self._order = itertools.count()
        self._work_clock = 0.0
        self._last = clock.now()
        self._generation = 0
        self.busy_s = 0.0  # time with at least one job: utilization = busy_s / elapsed
        self.work_s = 0.0  # device seconds submitted
        self._blocked: deque[tuple[float, float]] = deque()  # (start, end): no job progresses, in time order

    @property
    def active(self) -> int:
        return len(self._jobs)

    def submit(self, work_s: float, callback: Callable[[], None]) -> None:
        """Run `work_s` seconds of device work; call `callback` when it is done."""
        self._advance()
        self.work_s += work_s
        heapq.heappush(self._jobs, (self._work_clock + work_s, next(self._order), callback))
        self._reschedule()

    def block(self, start: float, end: float) -> None:
        """No job progresses from `start` to `end` (work that has the device first: a front end on a CPU
        replica's core). Blocks come in time order and do not overlap."""
        self._advance()
        self._blocked.append((start, end))
        self._reschedule()

    def _open(self, start: float, end: float) -> float:
        """Seconds from `start` to `end` outside every block."""
        total = end - start
        for s, e in self._blocked:
            if s >= end:
                break
            total -= max(0.0, min(e, end) - max(s, start))
        return total

    def _after(self, start: float, work: float) -> float:
        """When `work` seconds outside the blocks have passed since `start`."""
        t = start
        for s, e in self._blocked:
            if e <= t:
                continue
            if s >= t + work:
                break
            work -= max(0.0, s - t)
            t = e
        return t + work

    def _advance(self) -> None:
        now = self._clock.now()
        if self._jobs and now > self._last:
            self._work_clock += self._open(self._last, now) / len(self._jobs)
            self.busy_s += now - self._last
        self._last = now
        while self._blocked and self._blocked[0][1] <= now:
            self._blocked.popleft()

    def _reschedule(self) -> None:
        self._generation += 1
        if self._jobs:
            left = max(self._jobs[0][0] - self._work_clock, 0.0)
            self._clock.call_at(self._after(self._last, left * len(self._jobs)), self._complete, self._generation)

    def _complete(self, generation: int) -> None:
        if generation != self._generation:
            return  # superseded: the set of jobs changed since this completion was scheduled
        self._advance()
        jobs = self._jobs
        # The head job is due now by construction (the job set has not changed since this call was scheduled), even
        # where the clock's rounding left its work a hair short: at a loop time of hours one ulp is ~1e-12 s, and
        # waiting for the rest would schedule this same instant again forever.
        self._work_clock = max(self._work_clock, jobs[0][0])
        done = []
        while jobs and jobs[0][0] <= self._work_clock + _EPS:
            done.append(heapq.heappop(jobs)[2])
        self._reschedule()
        for callback in done:
            callback()
