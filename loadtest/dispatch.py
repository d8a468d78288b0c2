"""Dispatching requests under gevent: open loop (at scheduled times) or closed loop (fixed concurrency).

Open loop spawns one greenlet per request at its scheduled time and never waits for earlier requests,
so concurrency grows when the server slows down and the offered load stays what the schedule says.
The lag between the scheduled and the actual send time is recorded for every request.

Multi-turn chats: the schedule gives each conversation's start; a conversation's turns go one after another, each
a think time after the previous reply ended (its scheduled time), carrying the history with the reply's text.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import gevent
from gevent.pool import Group

from loadtest.chats import CHAT_OVERHEAD_TOKENS, Chats, ChatSpec
from loadtest.records import RequestRecord
from loadtest.workloads import RequestSpec, Workload

logger = logging.getLogger(__name__)

KILL_TIMEOUT_S = 10.0


class Sender(Protocol):
    """Sends one request and measures it (StreamingClient)."""

    def start_clock(self) -> None: ...

    def now(self) -> float: ...

    def send(self, request: RequestSpec, scheduled_s: float | None) -> RequestRecord: ...

    def exchange(self, request: RequestSpec, scheduled_s: float | None) -> tuple[RequestRecord, str]: ...


@dataclass(frozen=True)
class DispatchResult:
    """How a dispatch went."""

    scheduled: int  # requests in the schedule (open loop); the requests sent (closed loop)
    sent: int
    drained: bool  # every request finished before the drain timeout
    max_in_flight: int


class Dispatcher:
    """Runs one open- or closed-loop load and hands each finished request's record to `on_record`."""

    def __init__(self, sender: Sender, on_record: Callable[[RequestRecord], None], drain_timeout: float) -> None:
        self._sender = sender
        self._on_record = on_record
        self._drain_timeout = drain_timeout
        self._group = Group()
        self._sent = 0
        self._in_flight = 0
        self._max_in_flight = 0
        self._indices = itertools.count()
        self._last_send = 0.0

    def open_loop(self, workload: Workload, times: Sequence[float]) -> DispatchResult:
        """Send request i at times[i] seconds after now, whatever happened to the earlier ones."""
        self._sender.start_clock()
        for index, at in enumerate(times):
            request = workload.request(index)  # built while waiting, not after the due time
            gevent.sleep(max(at - self._sender.now(), 0.0))  # sleep(0) still lets the greenlets due run first
            self._group.spawn(self._one, request, float(at))
        drained = self._drain(self._drain_timeout)
        return DispatchResult(len(times), self._sent, drained, self._max_in_flight)

    def closed_loop(self, workload: Workload, concurrency: int, num_requests: int | None,
                    duration: float) -> DispatchResult:
        """Keep `concurrency` requests in flight until `num_requests` are sent or `duration` has passed."""
        self._sender.start_clock()
        counter = itertools.count()
        limit = num_requests if num_requests is not None else math.inf

        def worker() -> None:
            while (index := next(counter)) < limit and self._sender.now() < duration:
                self._one(workload.request(index), None)

        for _ in range(concurrency):
            self._group.spawn(worker)
        drained = self._drain(None if math.isinf(duration) else duration + self._drain_timeout)
        return DispatchResult(self._sent, self._sent, drained, self._max_in_flight)

    def open_loop_chats(self, chats: Chats, times: Sequence[float]) -> DispatchResult:
        """Start conversation i at times[i] seconds after now, whatever happened to the earlier ones."""
        self._sender.start_clock()
        for index, at in enumerate(times):
            chat = chats.chat(index)
            gevent.sleep(max(at - self._sender.now(), 0.0))
            self._group.spawn(self._chat, chat, float(at))
        drained = self._drain_chats()
        return DispatchResult(self._sent, self._sent, drained, self._max_in_flight)

    def closed_loop_chats(self, chats: Chats, concurrency: int, num_requests: int | None,
                          duration: float) -> DispatchResult:
        """Keep `concurrency` conversations going, each user starting another when one ends, until `num_requests`
        turns are sent or `duration` has passed."""
        self._sender.start_clock()
        counter = itertools.count()
        limit = num_requests if num_requests is not None else math.inf

        def user() -> None:
            while self._sent < limit and self._sender.now() < duration:
                self._chat(chats.chat(next(counter)), self._sender.now(), limit, duration)

        for _ in range(concurrency):
            self._group.spawn(user)
        drained = self._drain_chats()
        return DispatchResult(self._sent, self._sent, drained, self._max_in_flight)

    def _chat(self, chat: ChatSpec, start_s: float, limit: float = math.inf, until_s: float = math.inf) -> None:
        """One conversation: each turn after its think time, with the history so far and the replies' text."""
        history = [("system", chat.system)] if chat.system else []
        context = chat.system_tokens + CHAT_OVERHEAD_TOKENS if chat.system else 0
        due = start_s
        for number, turn in enumerate(chat.turns):
            due += turn.think_s
            gevent.sleep(max(due - self._sender.now(), 0.0))
            if self._sent >= limit or self._sender.now() >= until_s:
                return
            context += turn.message_tokens + CHAT_OVERHEAD_TOKENS
            request = RequestSpec(next(self._indices), turn.message, context, turn.max_tokens, tuple(history),
                                  chat.index, number)
            record, reply = self._exchange(request, due)
            if not record.ok:
                return  # the user gives up on this conversation
            history += [("user", turn.message), ("assistant", reply)]
            context += record.output_tokens + CHAT_OVERHEAD_TOKENS
            due = self._sender.now()

    def _drain_chats(self) -> bool:
        """Wait for the conversations; cancel them once no turn has been sent for the drain timeout."""
        while not self._group.join(timeout=1.0):
            if self._sender.now() - self._last_send > self._drain_timeout:
                logger.warning("no turn sent for %.0f s; cancelling %d conversations", self._drain_timeout,
                               len(self._group))
                self._group.kill(block=True, timeout=KILL_TIMEOUT_S)
                return False
        return True

    def stop(self) -> None:
        """Cancel what is in flight (each cancelled request is still recorded)."""
        self._group.kill(block=True, timeout=KILL_TIMEOUT_S)

    def _drain(self, timeout: float | None) -> bool:
        """Wait for what is in flight; past `timeout` seconds cancel it. Whether all finished in time."""
        if self._group.join(timeout=timeout):
            return True
        logger.warning("%d requests still in flight after the drain timeout; cancelling them", len(self._group))
        self._group.kill(block=True, timeout=KILL_TIMEOUT_S)
        return False

    def _one(self, request: RequestSpec, scheduled_s: float | None) -> None:
        self._exchange(request, scheduled_s)

    def _exchange(self, request: RequestSpec, scheduled_s: float | None) -> tuple[RequestRecord, str]:
        self._sent += 1
        self._in_flight += 1
        self._max_in_flight = max(self._max_in_flight, self._in_flight)
        self._last_send = self._sender.now()
        try:
            record, reply = self._sender.exchange(request, scheduled_s)
        finally:
            self._in_flight -= 1
        self._on_record(record)
        return record, reply
