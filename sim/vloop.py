"""An asyncio event loop whose clock is virtual: when nothing is ready it jumps to the next timer.

Coroutines written for real time (`asyncio.sleep`, `asyncio.wait(..., timeout=...)`, `loop.call_at`) run
unchanged but without waiting, so the gateway's own admission queue (`gateway.router.Router.acquire`, with its
futures and timeouts) can be exercised over hours of simulated traffic in seconds. Only for code that does no
real I/O: sockets still work, but the clock does not wait for them.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; a select that would have blocked for `timeout` moves the clock on instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
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
        super().__init__(selector=_JumpingSelector(self))
        self._clock_resolution = 1e-9

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
