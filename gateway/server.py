"""The gateway's HTTP/1.1 server: httptools (llhttp, the parser aiohttp also uses) on a plain asyncio protocol.

Why not aiohttp's server: on a 2-core machine at 100 requests/s, a bare aiohttp proxy (aiohttp's server and
client, no gateway logic) added 1.0-1.4 ms to the median request, where the gateway's target is under 1 ms; a
minimal proxy on httptools protocols added 0.57-0.74 ms, a raw byte forwarder 0.46-0.53 ms (README, "Gateway
overhead"). aiohttp still probes the replicas (health.py); this module serves only what the gateway needs:

- keep-alive, and pipelined requests answered in order;
- Content-Length and chunked request bodies up to `max_body` (413 beyond it), `Expect: 100-continue`;
- complete responses written in one call, or streamed with chunked encoding and write back-pressure;
- 400 for malformed HTTP, 431 for a head over 64 KiB; a connection quiet for `keepalive_s` is closed;
- deadlines for slow clients (`Deadlines`): a whole request head, each body read and a minimum body rate (408
  past them), and an answer the client does not read (the connection is cut off, cancelling the handler);
- at most `max_connections` open connections. At the cap, the connection that opened longest ago and has not
  sent its first request head whole for `Deadlines.shed_s` gives way to a new one (answered 408 and closed), so
  slow clients cannot hold the cap; with none such, the next few are answered 503 with `Retry-After`, and beyond
  those the server stops accepting (they wait in the kernel's backlog) until one closes or one can give way; out
  of file descriptors when accepting, one spare descriptor is given up to answer 503 (see SECURITY.md);
- a client that disconnects cancels its handler at once (so the proxy can abort the upstream request);
- a graceful stop: stop listening, let requests in flight finish within a grace period, then cancel them.

The connection itself is in three modules, split by concern as uvicorn splits its protocol: its life and deadlines
(http_connection.py), reading a request (http_request.py), writing a response (http_response.py). This module
accepts connections and keeps count of them; the names a handler needs are importable from here.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from email.utils import formatdate

from .http_connection import Connection, Deadlines
from .http_request import MAX_HEAD, MAX_PIPELINED, Request
from .http_response import Handler, Responder, Response
from .limits import OUT_OF_DESCRIPTORS, Throttled, default_max_connections

__all__ = ["Connection", "Deadlines", "Handler", "HttpServer", "Request", "Responder", "Response"]

logger = logging.getLogger(__name__)

_Connection = Connection  # the fuzzing harnesses drive connections directly
_MAX_HEAD, _MAX_PIPELINED = MAX_HEAD, MAX_PIPELINED  # the HTTP tests size their requests by these
REFUSING = 16  # connections over max_connections answered 503 at a time; beyond them, accepting waits
_ACCEPT_RETRY_S = 0.1  # out of descriptors when accepting: try again after this (asyncio waits 1 s, nginx 0.5 s)
_GONE_ON_ACCEPT = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM)  # the client left before accept() returned
_EARLY_S = 0.001  # a timer may fire a hair before its time: a connection this close to shed_s is due


class HttpServer:
    """Listens on a host and port and answers every request with `handler`."""

    def __init__(self, handler: Handler, max_body: int, keepalive_s: float = 75.0, discard_s: float = 5.0, *,
                 deadlines: Deadlines | None = None, max_connections: int | None = None,
                 on_shed: Callable[[], None] | None = None) -> None:
        self.handler = handler
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.discard_s = discard_s
        self.deadlines = deadlines or Deadlines()
        self.max_connections = max_connections or default_max_connections()
        self.connections: set[Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._serving = 0  # accepted within max_connections, not yet closed
        self._refusing = 0  # accepted over it, being answered 503
        # within the cap, with no whole request head yet, in the order they opened: the first gives way at the cap
        self.headless: dict[Connection, None] = {}
        self._shedding = 0  # given way at the cap, not yet closed
        self._shed_timer: asyncio.TimerHandle | None = None  # accepting waits for the oldest headless one to be due
        self._on_shed = on_shed  # a metric
        self._listeners: list[socket.socket] = []
        self._accepting = False
        self._closed = False
        self._retry: asyncio.TimerHandle | None = None
        self._spare: int | None = None  # a descriptor held back, to answer 503 when accept() finds none left
        self._attaching: set[asyncio.Task[None]] = set()
        self._date = (0, b"")
        self.warn = Throttled(logger).warning

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Listen (on `sock` if given: a listening socket, perhaps shared with other processes); returns the port."""
        self._listeners = [sock] if sock is not None else _listen(host, port)
        for listener in self._listeners:
            listener.setblocking(False)
        self._spare = _reserve()
        self._resume_accepting()
        logger.info("accepting up to %d client connections", self.max_connections)
        return int(self._listeners[0].getsockname()[1])

    async def start_unix(self, path: str) -> None:
        """Listen on a Unix socket (the supervisor's admin API, for its workers)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        self._listeners = [sock]
        self._spare = _reserve()
        self._resume_accepting()

    # -- accepting ----------------------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        """Accept what is waiting, while there is room (connections, then refusals); else stop until one closes.

        At the cap, a connection that has sent no whole request head within `shed_s` of opening gives way to the
        new one, oldest first: a new connection is refused (503, or left in the backlog) only when none can.
        """
        while True:
            over = self._serving >= self.max_connections
            if over and self._refusing >= REFUSING and not self._can_shed():
                break
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in OUT_OF_DESCRIPTORS:
                    self._out_of_descriptors(listener, exc)
                    return
                if exc.errno in _GONE_ON_ACCEPT:
                    continue
                self.warn("accept() failed (%s): not accepting for %g s", exc, _ACCEPT_RETRY_S)  # ENOBUFS, ENOMEM
                self._pause_accepting()
                self._retry = self.loop.call_later(_ACCEPT_RETRY_S, self._retry_accepting)
                return
            if over and self._can_shed():
                self._shed_oldest()
                over = False
            self._attach(sock, over=over)
        self._pause_accepting()
        self._shed_when_due()

    def _can_shed(self) -> bool:
        if not self.headless or self._shedding >= REFUSING:  # each one shed holds its descriptor until it closes
            return False
        return next(iter(self.headless)).opened_at + self.deadlines.shed_s <= self.loop.time() + _EARLY_S

    def _shed_oldest(self) -> None:
        """Close the connection waiting longest for its first request head; its room goes to a new one."""
        conn = next(iter(self.headless))
        self._serving -= 1
        self._shedding += 1
        conn.shed()
        if self._on_shed is not None:
            self._on_shed()

    def _shed_when_due(self) -> None:
        """Accepting has stopped at the cap: try again when the oldest headless connection may give way."""
        if self._shed_timer is None and self.headless and self._shedding < REFUSING:
            due = next(iter(self.headless)).opened_at + self.deadlines.shed_s
            self._shed_timer = self.loop.call_at(due, self._shed_due)

    def _shed_due(self) -> None:
        self._shed_timer = None
        if self._retry is None:
            self._resume_accepting()

    def _attach(self, sock: socket.socket, over: bool, spare: bool = False) -> None:
        sock.setblocking(False)
        if over:
            self._refusing += 1
        else:
            self._serving += 1
        task = self.loop.create_task(self._connect(sock, over, spare))
        self._attaching.add(task)
        task.add_done_callback(self._attaching.discard)

    async def _connect(self, sock: socket.socket, over: bool, spare: bool) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: Connection(self, over, spare), sock)
        except asyncio.CancelledError:  # the server is closing
            sock.close()
            raise
        except OSError as exc:  # the client left already, or no memory for a transport: as if it had closed
            logger.debug("cannot take on an accepted connection: %r", exc)
            sock.close()
            self.released(over, spare)

    def released(self, over: bool, spare: bool, shed: bool = False) -> None:
        """A connection closed: its room is free again."""
        if shed:
            self._shedding -= 1  # its room went to a new connection when it was shed
        elif over:
            self._refusing -= 1
        else:
            self._serving -= 1
        if spare:
            self._spare = _reserve()
        if not self._accepting and self._retry is None:
            self._resume_accepting()

    def _out_of_descriptors(self, listener: socket.socket, exc: OSError) -> None:
        """accept() found no descriptor: give up the spare one to answer one client 503, and pause accepting."""
        self._pause_accepting()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
            try:
                sock, _ = listener.accept()
            except OSError:
                self._spare = _reserve()
            else:
                self._attach(sock, over=True, spare=True)
                self.warn("out of file descriptors (%s): answering 503 until some are free", exc.strerror)
                return  # accepting resumes when that connection closes and the spare is back
        self.warn("out of file descriptors (%s): not accepting for %g s", exc.strerror, _ACCEPT_RETRY_S)
        self._retry = self.loop.call_later(_ACCEPT_RETRY_S, self._retry_accepting)

    def _retry_accepting(self) -> None:
        self._retry = None
        if self._spare is None:
            self._spare = _reserve()
        self._resume_accepting()

    def _pause_accepting(self) -> None:
        if self._accepting:
            self._accepting = False
            for listener in self._listeners:
                self.loop.remove_reader(listener.fileno())

    def _resume_accepting(self) -> None:
        if not self._accepting and not self._closed:
            self._accepting = True
            for listener in self._listeners:
                self.loop.add_reader(listener.fileno(), self._accept, listener)

    # -- serving --------------------------------------------------------------------------------------------------
    def date(self) -> bytes:
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]

    async def close(self, grace_s: float) -> None:
        """Stop listening, let requests in flight finish for up to `grace_s`, then cancel what remains."""
        self._pause_accepting()
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._shed_timer is not None:
            self._shed_timer.cancel()
            self._shed_timer = None
        for listener in self._listeners:
            listener.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while True:
            for conn in list(self.connections):
                if conn.idle:
                    conn.close()
            if not self.connections or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close()
        for task in list(self._attaching):
            task.cancel()


def _listen(host: str, port: int, backlog: int = 1024) -> list[socket.socket]:
    """Listening sockets for `host` (every address it resolves to) and `port`, as asyncio's create_server makes."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if listeners[0] is not sock:  # port 0 on several addresses: the same port on each
                address = (address[0], listeners[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(backlog)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return listeners


def _reserve() -> int | None:
    """A descriptor to give up when accept() finds none, so that a client can be told 503 rather than reset."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
