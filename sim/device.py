"""One GPU shared by the replicas on it: their device work time-shares it; their host work overlaps.

Each replica's step submits its device part (seconds of work on an otherwise idle GPU). While k replicas have
device work outstanding, each progresses at 1/k speed (processor sharing: under MPS or time-slicing, memory-bound
kernels of several processes split the memory bandwidth). The host parts do not appear here: a replica's host
part runs while the GPU serves the others, and that overlap is what replication buys.
"""

from __future__ import annotations

from collections.abc import Callable

from .clock import Clock

_EPS = 1e-9  # seconds of work: a job this close to done is done (float rounding)


class _Job:
    __slots__ = ("remaining", "callback")

    def __init__(self, remaining: float, callback: Callable[[], None]) -> None:
        self.remaining = remaining
        self.callback = callback


class SharedDevice:
    """A GPU whose device time the submitted jobs share equally."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._jobs: list[_Job] = []
        self._last = clock.now()
        self._generation = 0
        self.busy_s = 0.0  # time with at least one job: utilization = busy_s / elapsed
        self.work_s = 0.0  # device seconds submitted

    @property
    def active(self) -> int:
        return len(self._jobs)

    def submit(self, work_s: float, callback: Callable[[], None]) -> None:
        """Run `work_s` seconds of device work; call `callback` when it is done."""
        self._advance()
        self.work_s += work_s
        self._jobs.append(_Job(work_s, callback))
        self._reschedule()

    def _advance(self) -> None:
        now = self._clock.now()
        jobs = self._jobs
        if jobs and now > self._last:
            share = (now - self._last) / len(jobs)
            for job in jobs:
                job.remaining -= share
            self.busy_s += now - self._last
        self._last = now

    def _reschedule(self) -> None:
        self._generation += 1
        if self._jobs:
            first = min(job.remaining for job in self._jobs)
            when = self._clock.now() + max(first, 0.0) * len(self._jobs)
            self._clock.call_at(when, self._complete, self._generation)

    def _complete(self, generation: int) -> None:
        if generation != self._generation:
            return  # superseded: the set of jobs changed since this completion was scheduled
        self._advance()
        done = [job for job in self._jobs if job.remaining <= _EPS]
        self._jobs = [job for job in self._jobs if job.remaining > _EPS]
        self._reschedule()
        for job in done:
            job.callback()
