"""An asyncio event loop whose clock is virtual: when nothing is ready it jumps to the next timer.

Coroutines written for real time (`asyncio.sleep`, `asyncio.wait(..., timeout=...)`, `loop.call_at`) run
unchanged but without waiting, so the gateway's own admission queue (`gateway.router.Router.acquire`, with its
futures and timeouts) can be exercised over hours of simulated traffic in seconds. Only for code that does no
real I/O: sockets still work, but the clock does not wait for them (loopback sockets deliver within the
sender's write, so a reply between local servers is ready at once). Work handed to an executor (`getaddrinfo`, which
HTTP clients run in a thread) is waited for in real time: the clock stands still until it is done, or a client's
connect would find the clock moved on by whatever timer came next.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar, TypeVarTuple, Unpack

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; a select that would have blocked for `timeout` moves the clock on instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self._loop.in_executor and timeout != 0:
            return super().select(None)  # woken by the executor's call_soon_threadsafe when its work is done
        events = super().select(0)
        if not events and timeout is not None and timeout > 0:
            self._loop.advance(timeout)
        elif not events and timeout is None:
            raise RuntimeError("virtual-time loop: nothing is scheduled and nothing is ready (a deadlock)")
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop on virtual time (starting at 0)."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        self.in_executor = 0  # executor jobs not yet done: the clock waits for them
        super().__init__(selector=_JumpingSelector(self))
        self._clock_resolution = 1e-9

    def run_in_executor(self, executor: Executor | None, func: Callable[[Unpack[Ts]], T],
                        *args: Unpack[Ts]) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.in_executor += 1
        future.add_done_callback(self._executor_done)
        return future

    def _executor_done(self, _: asyncio.Future[Any]) -> None:
        self.in_executor -= 1

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
