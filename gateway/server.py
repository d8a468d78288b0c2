"""The gateway's HTTP/1.1 server: httptools (llhttp, the parser aiohttp also uses) on a plain asyncio protocol.

Why not aiohttp's server: on a 2-core machine at 100 requests/s, a bare aiohttp proxy (aiohttp's server and
client, no gateway logic) added 1.0-1.4 ms to the median request, where the gateway's target is under 1 ms; a
minimal proxy on httptools protocols added 0.57-0.74 ms, a raw byte forwarder 0.46-0.53 ms (README, "Gateway
overhead"). aiohttp still probes the replicas (health.py); this module serves only what the gateway needs:

- keep-alive, and pipelined requests answered in order;
- Content-Length and chunked request bodies up to `max_body` (413 beyond it), `Expect: 100-continue`;
- complete responses written in one call, or streamed with chunked encoding and write back-pressure;
- 400 for malformed HTTP, 431 for a head over 64 KiB; a connection quiet for `keepalive_s` is closed;
- a client that disconnects cancels its handler at once (so the proxy can abort the upstream request);
- a graceful stop: stop listening, let requests in flight finish within a grace period, then cancel them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

import httptools

from .errors import GatewayError

logger = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_PIPELINED = 16  # stop reading from a client that queues more requests than this
_MAX_HEAD = 64 * 1024  # request line and headers; httptools itself sets no bound


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

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
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
        self._paused = False
        self._discarding = False  # refused a request: read and drop the rest, then close
        self._refusal: tuple[bytes, bool] | None = None  # an error answer owed once earlier requests are answered
        self._refused_read = False  # the refused request has been read to its end
        self._continue_owed = False  # a `100 Continue` to send once earlier requests are answered
        self._head_size = 0  # bytes of the current request's head so far (-1 once it is complete)
        self._stalled = 0  # bytes fed with no header or URL completed: one header growing
        self._progress = False
        self._last = self._loop.time()
        self._idle = self._loop.call_at(self._last + server.keepalive_s, self._check_idle)
        self.closing = False

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

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._idle.cancel()
        self._server.connections.discard(self)
        if self._task is not None:
            self._task.cancel()  # the client went away: stop working for it
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    # -- httptools callbacks ----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", {}, [], 0
        self._head_size, self._progress = 0, True

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
        if self._discarding:
            return
        if too_large:
            self._refuse(431, f"the request line and headers are larger than {_MAX_HEAD} bytes",
                         "request_header_fields_too_large")
            return
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > self._server.max_body:
            self._too_large()
        elif (self._headers.get("expect", "").lower() == "100-continue"
              and self._parser.get_http_version() == "1.1" and self._transport is not None):
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
        if self._waiter is not None:
            self._waiter.set_result(None)
            self._waiter = None
        elif self._task is None:
            self._task = self._loop.create_task(self._serve())
        if len(self._queue) >= _MAX_PIPELINED and self._transport is not None:
            self._transport.pause_reading()

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
                    self._waiter = self._loop.create_future()
                    await self._waiter
                request = self._queue.popleft()
                if len(self._queue) == _MAX_PIPELINED - 1 and self._transport is not None:
                    self._transport.resume_reading()
                self._busy = True
                await self._answer(request)
                self._busy = False
                self._last = self._loop.time()
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
        except Exception:  # a bug in a handler: answer 500 and keep serving the others
            logger.exception("error serving %s %s", request.method, request.target)
            if responder.started:
                self.close()
                return
            response = Response(500, GatewayError(500, "internal gateway error", code="internal_error").encoded())
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
        if self._paused:
            self._drain = self._loop.create_future()
            await self._drain
            if self.closing:
                raise ConnectionResetError("the client closed the connection")

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def _refuse(self, status: int, message: str, code: str, linger: bool = False) -> None:
        """Answer an error the server finds itself, after the answers still owed on this connection; then close.

        `linger`: the client may still be sending a body; read and drop it (for up to `discard_s`) so the client
        sees the answer rather than a reset.
        """
        self._discarding = True
        self._body = []
        body = GatewayError(status, message, code=code).encoded()
        answer = (b"HTTP/1.1 %d %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                  b"Connection: close\r\n\r\n%b" % (status, _REASONS[status], len(body), body))
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
        waiting = self._headers.get("expect", "").lower() == "100-continue"
        self._refuse(413, f"the request body is larger than {self._server.max_body} bytes", "request_too_large",
                     linger=not waiting)

    def _check_idle(self) -> None:
        now = self._loop.time()
        if not self.idle:
            self._idle = self._loop.call_at(now + self._server.keepalive_s, self._check_idle)
        elif now >= self._last + self._server.keepalive_s:
            self.close()
        else:
            self._idle = self._loop.call_at(self._last + self._server.keepalive_s, self._check_idle)

    def close(self) -> None:
        self.closing = True
        if self._transport is not None:
            self._transport.close()

    @property
    def idle(self) -> bool:
        return not self._busy and not self._queue


class HttpServer:
    """Listens on a host and port and answers every request with `handler`."""

    def __init__(self, handler: Handler, max_body: int, keepalive_s: float = 75.0, discard_s: float = 5.0) -> None:
        self.handler = handler
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.discard_s = discard_s
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._date = (0, b"")

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Listen (on `sock` when given: a worker's inherited socket); returns the bound port (useful with port 0)."""
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(lambda: _Connection(self), sock=sock, backlog=1024)
        else:
            self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                    backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    def date(self) -> bytes:
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]

    async def close(self, grace_s: float) -> None:
        """Stop listening, let requests in flight finish for up to `grace_s`, then cancel what remains."""
        if self._server is not None:
            self._server.close()
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
        if self._server is not None:
            await self._server.wait_closed()
