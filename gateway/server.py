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
- at most `max_connections` open connections: the next few are answered 503 with `Retry-After`, and beyond
  those the server stops accepting (they wait in the kernel's backlog) until one closes; out of file
  descriptors when accepting, one spare descriptor is given up to answer 503 (see SECURITY.md);
- a client that disconnects cancels its handler at once (so the proxy can abort the upstream request);
- a graceful stop: stop listening, let requests in flight finish within a grace period, then cancel them.

Every deadline is watched by the connection's one timer, moved only when a request arrives in more than one read
or the client stops reading: a request that arrives in one read costs no timer work.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

import httptools

from .errors import GatewayError, overloaded
from .limits import OUT_OF_DESCRIPTORS, Throttled, default_max_connections

logger = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_PIPELINED = 16  # stop reading from a client that queues more requests (or more than max_body of them) than this
_MAX_HEAD = 64 * 1024  # request line and headers; httptools itself sets no bound
REFUSING = 16  # connections over max_connections answered 503 at a time; beyond them, accepting waits
_ACCEPT_RETRY_S = 0.1  # out of descriptors when accepting: try again after this (asyncio waits 1 s, nginx 0.5 s)
_GONE_ON_ACCEPT = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM)  # the client left before accept() returned


@dataclass(frozen=True, slots=True)
class Deadlines:
    """What a client may take; see ClientConfig (config.py) for the defaults' reasons."""

    header_s: float = 20.0  # a whole request head, from its first byte (a new connection must begin one by then)
    body_s: float = 20.0  # between two reads of a request body
    body_min_rate: float = 1024.0  # bytes/s: a body must have arrived by body_s + bytes / rate after its head
    send_s: float = 60.0  # an answer the client reads nothing of for this long (its send buffer full) is cut off


@dataclass(frozen=True, slots=True)
class Request:
    """One parsed request. Header names are lower-case; `target` is the path and query as sent."""

    method: str
    target: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    http11: bool


@dataclass(frozen=True, slots=True)
class Response:
    """A complete response, written in one call."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class Responder:
    """Writes one request's response: either returned whole by the handler, or streamed through here."""

    __slots__ = ("_conn", "_request", "headers", "started", "_head")

    def __init__(self, conn: _Connection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self.headers: dict[str, str] = {}  # added to whatever response goes out (the request id)
        self.started = False
        self._head = b""

    @property
    def client_gone(self) -> bool:
        return self._conn.closing

    def start(self, status: int, headers: dict[str, str], content_type: str) -> None:
        """Begin a streamed response; the head goes out with the first chunk."""
        self.started = True
        self._head = self._conn.head(self._request, status, content_type, {**headers, **self.headers}, None)

    async def send(self, data: bytes) -> None:
        """One chunk of a streamed response; waits while the client reads slower than we write."""
        if self._request.http11:
            data = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        if self._head:
            data, self._head = self._head + data, b""
        await self._conn.write(data)

    async def finish(self) -> None:
        """End a streamed response (the head too, if no chunk was sent)."""
        tail = b"0\r\n\r\n" if self._request.http11 else b""
        data, self._head = self._head + tail, b""
        await self._conn.write(data)
        if not self._request.http11:
            self._conn.close()  # an HTTP/1.0 stream ends when the connection does


Handler = Callable[[Request, Responder], Awaitable["Response | None"]]


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs the handler for each in order, writes the responses."""

    def __init__(self, server: HttpServer, over: bool = False, spare: bool = False) -> None:
        self._server = server
        self._over = over  # accepted over max_connections: its request is answered 503
        self._spare = spare  # accepted with the spare descriptor, which is taken back when this closes
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
        self._last = self._loop.time()
        self._timer_at = self._last + self._idle_limit
        self._timer = self._loop.call_at(self._timer_at, self._check)
        self.closing = False
        self._lost = False

    # -- asyncio.Protocol -------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._last = self._loop.time()
        self._progress = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self._discarding:
                self._refuse(400, "protocol upgrades are not supported", "upgrade_not_supported")
            return
        except httptools.HttpParserError as exc:
            if not self._discarding:
                self._refuse(400, f"malformed HTTP request: {exc}", "bad_request")
            return
        if self._head_size >= 0:  # inside a request head: bound it (httptools buffers a header until it ends)
            self._stalled = 0 if self._progress else self._stalled + len(data)
            if max(self._head_size, self._stalled) > _MAX_HEAD:
                self._refuse(431, f"the request line and headers are larger than {_MAX_HEAD} bytes",
                             "request_header_fields_too_large")
        if self._in_request:  # the request continues in a later read: its deadline must be watched
            self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = self._lost = True
        self._timer.cancel()
        self._server.connections.discard(self)
        self._server.released(self._over, self._spare)
        if self._task is not None:
            self._task.cancel()  # the client went away: stop working for it
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused_at = self._loop.time()
        self._watch()

    def resume_writing(self) -> None:
        self._paused_at = None
        self._wake_writer()

    # -- httptools callbacks ----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", {}, [], 0
        self._head_size, self._progress = 0, True
        self._in_request = True
        self._head_start = self._last

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        self._progress = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        self._head_size += len(name) + len(value)
        self._progress = True

    def on_headers_complete(self) -> None:
        too_large, self._head_size = self._head_size > _MAX_HEAD, -1
        self._body_start = self._last
        if self._discarding:
            return
        if self._over:
            self._refuse(503, "the gateway has no room for another connection; retry shortly", "server_overloaded",
                         linger=not self._expects_continue, extra=b"Retry-After: 1\r\n")
            return
        if too_large:
            self._refuse(431, f"the request line and headers are larger than {_MAX_HEAD} bytes",
                         "request_header_fields_too_large")
            return
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):  # llhttp also takes HTTP/0.9 (no version at all) and HTTP/2.0 request lines
            self._refuse(400, f"HTTP/{version} is not supported: send HTTP/1.1 or HTTP/1.0", "unsupported_http_version")
            return
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > self._server.max_body:
            self._too_large()
        elif self._expects_continue and self._parser.get_http_version() == "1.1" and self._transport is not None:
            if self.idle:
                self._transport.write(_CONTINUE)
            else:
                self._continue_owed = True  # after the answers still owed on this connection

    def on_body(self, body: bytes) -> None:
        if self._discarding:
            return
        self._size += len(body)
        if self._size > self._server.max_body:
            self._too_large()
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_request = False
        if self._discarding:
            self._refused_read = True
            if self._refusal is None:
                self.close()  # the refusal went out already
            return
        if self._parser.should_upgrade():
            return  # refused when httptools raises HttpParserUpgrade right after this
        url = self._url.decode("latin-1")
        request = Request(self._parser.get_method().decode("latin-1"), url, url.partition("?")[0],
                          self._headers, b"".join(self._body), self._parser.should_keep_alive(),
                          self._parser.get_http_version() == "1.1")
        self._queue.append(request)
        self._queued += len(request.body)
        if self._waiter is not None:
            self._waiter.set_result(None)
            self._waiter = None
        elif self._task is None:
            self._task = self._loop.create_task(self._serve())
        if ((len(self._queue) >= _MAX_PIPELINED or self._queued > self._server.max_body)
                and self._transport is not None and not self._reading_paused):
            self._reading_paused = True  # memory per connection stays within a few times max_body
            self._transport.pause_reading()

    @property
    def _expects_continue(self) -> bool:
        return self._headers.get("expect", "").lower() == "100-continue"

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
                        self._transport.write(_CONTINUE)
                        self._body_start = self._last = self._loop.time()  # the body is due from now
                        self._watch()
                    self._waiter = self._loop.create_future()
                    await self._waiter
                request = self._queue.popleft()
                self._queued -= len(request.body)
                if (self._reading_paused and len(self._queue) < _MAX_PIPELINED
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

    async def _answer(self, request: Request) -> None:
        responder = Responder(self, request)
        try:
            response = await self._server.handler(request, responder)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug in a handler (500), or no file descriptor left (503); serve the others
            if responder.started:
                logger.exception("error serving %s %s", request.method, request.target)
                self.close()
                return
            if isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
                self._server.warn("out of file descriptors serving %s %s: %s", request.method, request.target, exc)
                error = overloaded("the gateway is out of file descriptors; retry shortly")
            else:
                logger.exception("error serving %s %s", request.method, request.target)
                error = GatewayError(500, "internal gateway error", code="internal_error")
            response = Response(error.status, error.encoded(), headers=error.headers)
        if response is not None and not self.closing:
            head = self.head(request, response.status, response.content_type,
                             {**response.headers, **responder.headers}, len(response.body))
            assert self._transport is not None
            self._transport.write(head if request.method == "HEAD" else head + response.body)

    def head(self, request: Request, status: int, content_type: str, headers: dict[str, str],
             length: int | None) -> bytes:
        """A response head; `length` None means a streamed body (chunked, or to the close on HTTP/1.0)."""
        lines = [b"HTTP/1.1 %d %b\r\nContent-Type: %b\r\nDate: %b\r\n"
                 % (status, _REASONS.get(status, b"Unknown"), content_type.encode("latin-1"), self._server.date())]
        if length is not None:
            lines.append(b"Content-Length: %d\r\n" % length)
        elif request.http11:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        if not request.keep_alive or (length is None and not request.http11):
            lines.append(b"Connection: close\r\n")
        elif not request.http11:
            lines.append(b"Connection: keep-alive\r\n")
        lines.extend(b"%b: %b\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
        lines.append(b"\r\n")
        return b"".join(lines)

    async def write(self, data: bytes) -> None:
        if self.closing or self._transport is None:
            raise ConnectionResetError("the client closed the connection")
        self._transport.write(data)
        if self._paused_at is not None:
            self._drain = self._loop.create_future()
            await self._drain
            if self.closing:
                raise ConnectionResetError("the client closed the connection")

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def _refuse(self, status: int, message: str, code: str, linger: bool = False, extra: bytes = b"") -> None:
        """Answer an error the server finds itself, after the answers still owed on this connection; then close.

        `linger`: the client may still be sending a body; read and drop it (for up to `discard_s`) so the client
        sees the answer rather than a reset.
        """
        self._discarding = True
        self._body = []
        body = GatewayError(status, message, code=code).encoded()
        answer = (b"HTTP/1.1 %d %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                  b"Connection: close\r\n%b\r\n%b" % (status, _REASONS[status], len(body), extra, body))
        if self.idle:
            self._write_refusal(answer, linger)
            return
        self._refusal = (answer, linger)
        if not linger and self._transport is not None:
            self._transport.pause_reading()  # nothing after a malformed request can be parsed

    def _write_refusal(self, answer: bytes, linger: bool) -> None:
        self._refusal = None
        if self._transport is not None and not self.closing:
            self._transport.write(answer)
        if linger and not self._refused_read:
            self._loop.call_later(self._server.discard_s, self.close)
        else:
            self.close()

    def _too_large(self) -> None:
        """413; the rest of the body is read and dropped (unless the client waits for `100 Continue` to send it)."""
        self._refuse(413, f"the request body is larger than {self._server.max_body} bytes", "request_too_large",
                     linger=not self._expects_continue)

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

    def close(self) -> None:
        self._closing()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping what the client has not read."""
        self._closing()
        if self._transport is not None:
            self._transport.abort()

    def _closing(self) -> None:
        if not self.closing:
            self.closing = True
            self._closed_at = self._loop.time()

    @property
    def idle(self) -> bool:
        return not self._busy and not self._queue


class HttpServer:
    """Listens on a host and port and answers every request with `handler`."""

    def __init__(self, handler: Handler, max_body: int, keepalive_s: float = 75.0, discard_s: float = 5.0, *,
                 deadlines: Deadlines | None = None, max_connections: int | None = None) -> None:
        self.handler = handler
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.discard_s = discard_s
        self.deadlines = deadlines or Deadlines()
        self.max_connections = max_connections or default_max_connections()
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._serving = 0  # accepted within max_connections, not yet closed
        self._refusing = 0  # accepted over it, being answered 503
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
        """Accept what is waiting, while there is room (connections, then refusals); else stop until one closes."""
        while self._serving < self.max_connections or self._refusing < REFUSING:
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
            self._attach(sock, over=self._serving >= self.max_connections)
        self._pause_accepting()

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
            await self.loop.connect_accepted_socket(lambda: _Connection(self, over, spare), sock)
        except asyncio.CancelledError:  # the server is closing
            sock.close()
            raise
        except OSError as exc:  # the client left already, or no memory for a transport: as if it had closed
            logger.debug("cannot take on an accepted connection: %r", exc)
            sock.close()
            self.released(over, spare)

    def released(self, over: bool, spare: bool) -> None:
        """A connection closed: its room is free again."""
        if over:
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
