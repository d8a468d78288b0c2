"""The time an engine runs in: a discrete-event core in virtual time, or an asyncio event loop's clock.

The engine only ever asks `now()` and `call_at(when, callback, *args)`. `VirtualClock` pops events off a heap
and jumps the time to each (no sleeping: a run of hours takes as long as its events take to process).
`LoopClock` hands the same calls to an asyncio loop, so `sim serve` runs the same engine in real time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> None: ...


class VirtualClock:
    """A discrete-event core: events run in time order (FIFO among equal times), the clock jumps between them."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._heap, (max(when, self._now), next(self._seq), callback, args))

    def run(self, until: float | None = None) -> None:
        """Process events until none is left (or the next is after `until`)."""
        heap, pop = self._heap, heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self._now = until
                return
            when, _, callback, args = pop(heap)
            self._now = when
            self.events += 1
            callback(*args)


class LoopClock:
    """An asyncio loop's clock (real time under a normal loop, virtual under `vloop.VirtualTimeLoop`).

    Inside a callback it scheduled, `now()` is the time the callback was due, not when the loop got to it: event
    loops wake timers up to a millisecond late (epoll and libuv count in milliseconds), and steps of a few
    milliseconds would otherwise drift by that much each. The simulated timeline stays exact; delivery is late
    by at most the loop's lag, which `max_lag_s` records.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: float | None = None
        self.max_lag_s = 0.0

    def now(self) -> float:
        return self._due if self._due is not None else self._loop.time()

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> None:
        self._loop.call_at(when, self._run, when, callback, args)

    def _run(self, when: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        lag = self._loop.time() - when
        if lag > self.max_lag_s:
            self.max_lag_s = lag
        self._due = when
        try:
            callback(*args)
        finally:
            self._due = None
