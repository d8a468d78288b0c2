"""Request timeouts: each request is cancelled once it made no progress for its limit; one timer checks them all."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Counted(Protocol):
    @property
    def relayed(self) -> int: ...


class Watch:
    """One request's timeout: `limit` seconds allowed since `last` (its latest sign of progress).

    Where progress comes once per token, it is counted in `moved` instead (no clock read per token), or in the
    `relayed` of `source` (a replica's answer relaying from its connection): a tick that finds either changed takes
    its own time as the latest progress, so such a timeout fires up to one tick later.
    """

    __slots__ = ("task", "limit", "last", "expired", "paused", "moved", "source", "_seen")

    def __init__(self, task: asyncio.Task[object] | None, limit: float, now: float) -> None:
        self.task = task
        self.limit = limit
        self.last = now
        self.expired = False
        self.paused = False
        self.moved = 0
        self.source: Counted | None = None
        self._seen = 0

    def progressed(self, now: float) -> bool:
        """Whether `moved` (or the source's count) changed since the last call; if so, `now` becomes the latest
        progress."""
        moved = self.moved if self.source is None else self.moved + self.source.relayed
        if moved == self._seen:
            return False
        self._seen = moved
        self.last = now
        return True


class Watchdogs:
    """Cancels requests that made no progress for their limit; one timer checks them all.

    A timer per request (asyncio.timeout, or call_at and cancel) cost more at 100 requests/s than the request's
    routing and accounting together (py-spy); this one ticks every `tick_s` while requests are in flight, so a
    timeout fires within `tick_s` after its limit (two ticks for a stream relayed from the replica's callback,
    whose progress a tick sees by `Watch.moved`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float) -> None:
        self._loop = loop
        self._tick_s = tick_s
        self._active: set[Watch] = set()
        self._handle: asyncio.TimerHandle | None = None

    def watch(self, limit: float) -> Watch:
        loop = self._loop
        watch = Watch(asyncio.current_task(loop), limit, loop.time())
        self._active.add(watch)
        if self._handle is None:
            self._handle = loop.call_later(self._tick_s, self._tick)
        return watch

    def rearm(self, watch: Watch, limit: float) -> None:
        """From now on, allow `limit` seconds between two signs of progress."""
        watch.limit = limit
        watch.last = self._loop.time()

    def timed_out(self, watch: Watch) -> bool:
        """After a CancelledError: whether it was `watch` expiring (the cancellation is then undone)."""
        if watch.expired:
            asyncio.current_task(self._loop).uncancel()  # type: ignore[union-attr]
        return watch.expired

    def done(self, watch: Watch) -> None:
        self._active.discard(watch)

    def _tick(self) -> None:
        loop = self._loop
        now = loop.time()
        for watch in list(self._active):
            if watch.paused or watch.progressed(now):
                watch.last = now
            elif now - watch.last >= watch.limit and watch.task is not None:
                watch.expired = True
                self._active.discard(watch)
                watch.task.cancel()
        self._handle = loop.call_later(self._tick_s, self._tick) if self._active else None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
