"""A client connection's life: its state, the task that answers its requests in order, its deadlines, its close.

A `Connection` is one asyncio protocol in three layers, split by concern as uvicorn splits its protocol: reading a
request (http_request.py), writing a response (http_response.py), and here what lives as long as the connection.
The layers are base classes of one class, so a call between them costs what it did in one module.

Every deadline is watched by the connection's one timer, moved only when a request arrives in more than one read
or the client stops reading: a request that arrives in one read costs no timer work.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import httptools

from .http_request import CONTINUE, MAX_PIPELINED, Request
from .http_response import ResponseWriter

if TYPE_CHECKING:
    from .server import HttpServer


@dataclass(frozen=True, slots=True)
class Deadlines:
    """What a client may take; see ClientConfig (config.py) for the defaults' reasons."""

    header_s: float = 20.0  # a whole request head, from its first byte (a new connection must begin one by then)
    body_s: float = 20.0  # between two reads of a request body
    body_min_rate: float = 1024.0  # bytes/s: a body must have arrived by body_s + bytes / rate after its head
    send_s: float = 60.0  # an answer the client reads nothing of for this long (its send buffer full) is cut off
    shed_s: float = 1.0  # at the connection cap, one with no whole request head this long after it opened gives way


class Connection(ResponseWriter):
    """One client connection: parses requests, runs the handler for each in order, writes the responses."""

    def __init__(self, server: HttpServer, over: bool = False, spare: bool = False) -> None:
        self._server = server
        self._over = over  # accepted over max_connections: its request is answered 503
        self._spare = spare  # accepted with the spare descriptor, which is taken back when this closes
        self._new = not over  # no whole request head yet: in the server's `headless`, may be shed at the cap
        self._shed = False  # shed at the cap to make room for a new connection
        self._loop = server.loop
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None  # serves the requests, one after another
        self._waiter: asyncio.Future[None] | None = None  # the task waits here for the next request
        self._busy = False
        self._drain: asyncio.Future[None] | None = None
        self._paused_at: float | None = None  # when the send buffer filled up (None: it has room)
        self._closed_at = 0.0
        self._queued = 0  # bytes of request bodies queued
        self._reading_paused = False  # by us, for pipelining: the client's deadlines wait
        self._discarding = False  # refused a request: read and drop the rest, then close
        self._refusal: tuple[bytes, bool] | None = None  # an error answer owed once earlier requests are answered
        self._refused_read = False  # the refused request has been read to its end
        self._continue_owed = False  # a `100 Continue` to send once earlier requests are answered
        self._head_size = 0  # bytes of the current request's head so far (-1 once it is complete)
        self._stalled = 0  # bytes fed with no header or URL completed: one header growing
        self._progress = False
        self._in_request = False  # a request has begun arriving and has not arrived whole
        self._head_start = self._body_start = 0.0
        deadlines = server.deadlines
        self._head_limit = min(deadlines.header_s, server.discard_s) if over else deadlines.header_s
        self._idle_limit = min(server.keepalive_s, self._head_limit)  # until the first request: as for a head
        self._last = self.opened_at = self._loop.time()
        self._timer_at = self._last + self._idle_limit
        self._timer = self._loop.call_at(self._timer_at, self._check)
        self.closing = False
        self._lost = False
        # The transport while a write goes out at once (not closing, the client not behind), else None: checked by
        # a replica connection relaying tokens straight to this one (upstream.py, UpstreamResponse.relay_to)
        self.open_transport: asyncio.Transport | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        self.open_transport = self._transport
        self._server.connections.add(self)
        if self._new:
            self._server.headless[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = self._lost = True
        self.open_transport = None
        self._timer.cancel()
        self._server.connections.discard(self)
        if self._new:
            self._left_headless()
        self._server.released(self._over, self._spare, self._shed)
        if self._task is not None:
            self._task.cancel()  # the client went away: stop working for it
        self._wake_writer()
        # The parser holds this connection's callbacks, and so this connection: a cycle, left for a collection.
        # Nothing is parsed after the connection is lost; a parser without callbacks takes its place.
        self._parser = httptools.HttpRequestParser(object())

    def pause_writing(self) -> None:
        self._paused_at = self._loop.time()
        self.open_transport = None
        self._watch()

    def resume_writing(self) -> None:
        self._paused_at = None
        self.open_transport = None if self.closing else self._transport
        self._wake_writer()

    # -- serving ----------------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        """Answer this connection's requests in order, for as long as it lives.

        One task per connection rather than per request: creating a task costs more than waking one.
        """
        try:
            while True:
                if not self._queue:
                    if self._refusal is not None:
                        self._write_refusal(*self._refusal)
                        return
                    if self._continue_owed and self._transport is not None:
                        self._continue_owed = False
                        self._transport.write(CONTINUE)
                        self._body_start = self._last = self._loop.time()  # the body is due from now
                        self._watch()
                    self._waiter = self._loop.create_future()
                    await self._waiter
                request = self._queue.popleft()
                self._queued -= len(request.body)
                if (self._reading_paused and len(self._queue) < MAX_PIPELINED
                        and self._queued <= self._server.max_body and self._transport is not None):
                    self._reading_paused = False
                    self._transport.resume_reading()
                    # the client's deadlines count again from now: it was us who did not read
                    self._head_start = self._body_start = self._last = self._loop.time()
                    self._watch()
                self._busy = True
                await self._answer(request)
                self._busy = False
                self._last = self._loop.time()
                self._idle_limit = self._server.keepalive_s  # between requests: keep-alive, not the head's bound
                if not request.keep_alive or self.closing:
                    self.close()
                    return
        except ConnectionError:
            self.close()  # the client went away while a response streamed

    # -- deadlines ----------------------------------------------------------------------------------------------
    def _deadline(self) -> float:
        """When this connection times out in its present state (inf: none of the client's; the handler's apply)."""
        if self.closing:  # still flushing what was written: the client must read it
            return (self._paused_at or self._closed_at) + self._server.deadlines.send_s
        if self._paused_at is not None:
            return self._paused_at + self._server.deadlines.send_s
        if self._in_request and not self._discarding and not self._reading_paused:
            if self._head_size >= 0:
                return self._head_start + self._head_limit
            if not self._continue_owed:
                deadlines = self._server.deadlines
                return min(self._last + deadlines.body_s,
                           self._body_start + deadlines.body_s + self._size / deadlines.body_min_rate)
        if self.idle:
            return self._last + self._idle_limit
        return math.inf

    def _watch(self) -> None:
        """Bring the timer forward if the present state's deadline comes before it."""
        deadline = self._deadline()
        if deadline < self._timer_at:
            self._timer.cancel()
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._check)

    def _check(self) -> None:
        if self._lost:
            return
        now = self._loop.time()
        deadline = self._deadline()
        if now >= deadline:
            self._expire()
            deadline = self._deadline()  # a 408 may wait behind an answer in progress
        self._timer_at = max(now, min(deadline, now + self._server.keepalive_s))
        self._timer = self._loop.call_at(self._timer_at, self._check)

    def _expire(self) -> None:
        """The client took too long: answer 408 to a request that is arriving too slowly, else cut it off."""
        if self.closing or self._paused_at is not None:
            self._server.warn("cutting off a client that read nothing for %g s", self._server.deadlines.send_s)
            self.abort()
        elif self._in_request and self._head_size >= 0:
            self._refuse(408, f"the request head did not arrive within {self._head_limit:g} s", "request_timeout")
        elif self._in_request:
            deadlines = self._server.deadlines
            self._refuse(408, f"the request body arrived too slowly (more than {deadlines.body_s:g} s between reads, "
                              f"or under {deadlines.body_min_rate:g} bytes/s)", "request_timeout")
        else:
            self.close()

    # -- closing ----------------------------------------------------------------------------------------------
    def shed(self) -> None:
        """Give way to a new connection at the cap (HttpServer._accept): answer 408 and close."""
        self._left_headless()
        self._shed = True
        self._refuse(408, "the gateway is at its connection limit and this connection sent no whole request head "
                          f"within {self._server.deadlines.shed_s:g} s", "request_timeout")

    def close(self) -> None:
        self._closing()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping what the client has not read."""
        self._closing()
        if self._transport is not None:
            self._transport.abort()

    def _left_headless(self) -> None:
        """The first request head is whole, or the connection is closing: it is no longer one to shed at the cap."""
        self._new = False
        self._server.headless.pop(self, None)

    def _closing(self) -> None:
        if not self.closing:
            self.closing = True
            self.open_transport = None
            self._closed_at = self._loop.time()
            if self._new:
                self._left_headless()
