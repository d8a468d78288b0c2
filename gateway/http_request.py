"""Reading a request: httptools' callbacks on a client connection, and the request they build.

The first layer of a client connection (http_connection.Connection): it bounds a request head (`MAX_HEAD`, 431
past it) and body (`max_body`, 413 past it), refuses what it cannot serve (upgrades, HTTP/0.9 and 2.0: 400), sends
`100 Continue` when asked, and queues whole requests for the connection's task, pausing reading when too many
wait (`MAX_PIPELINED`, or more than `max_body` of bodies).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from .server import HttpServer

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
MAX_PIPELINED = 16  # stop reading from a client that queues more requests (or more than max_body of them) than this
MAX_HEAD = 64 * 1024  # request line and headers; httptools itself sets no bound


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


class RequestReader(asyncio.Protocol):
    """Parses a client's bytes into requests and queues them; the state is set by Connection.__init__."""

    _server: HttpServer
    _loop: asyncio.AbstractEventLoop
    _parser: httptools.HttpRequestParser
    _transport: asyncio.Transport | None
    _url: bytes
    _headers: dict[str, str]
    _body: list[bytes]
    _size: int
    _queue: deque[Request]
    _task: asyncio.Task[None] | None
    _waiter: asyncio.Future[None] | None
    _busy: bool
    _queued: int
    _reading_paused: bool
    _discarding: bool
    _refused_read: bool
    _refusal: tuple[bytes, bool] | None
    _continue_owed: bool
    _head_size: int
    _stalled: int
    _progress: bool
    _in_request: bool
    _head_start: float
    _body_start: float
    _last: float
    _over: bool
    _new: bool

    if TYPE_CHECKING:  # defined by the layers above (http_response.py, http_connection.py)
        def _refuse(self, status: int, message: str, code: str, linger: bool = False, extra: bytes = b"") -> None: ...
        def _watch(self) -> None: ...
        def _left_headless(self) -> None: ...
        def close(self) -> None: ...
        async def _serve(self) -> None: ...

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
            if max(self._head_size, self._stalled) > MAX_HEAD:
                self._refuse(431, f"the request line and headers are larger than {MAX_HEAD} bytes",
                             "request_header_fields_too_large")
        if self._in_request:  # the request continues in a later read: its deadline must be watched
            self._watch()

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
        too_large, self._head_size = self._head_size > MAX_HEAD, -1
        self._body_start = self._last
        if self._new:
            self._left_headless()
        if self._discarding:
            return
        if self._over:
            self._refuse(503, "the gateway has no room for another connection; retry shortly", "server_overloaded",
                         linger=not self._expects_continue, extra=b"Retry-After: 1\r\n")
            return
        if too_large:
            self._refuse(431, f"the request line and headers are larger than {MAX_HEAD} bytes",
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
                self._transport.write(CONTINUE)
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
            self._task.add_done_callback(_drop_cancellation)
        if ((len(self._queue) >= MAX_PIPELINED or self._queued > self._server.max_body)
                and self._transport is not None and not self._reading_paused):
            self._reading_paused = True  # memory per connection stays within a few times max_body
            self._transport.pause_reading()

    @property
    def _expects_continue(self) -> bool:
        return self._headers.get("expect", "").lower() == "100-continue"

    def _too_large(self) -> None:
        """413; the rest of the body is read and dropped (unless the client waits for `100 Continue` to send it)."""
        self._refuse(413, f"the request body is larger than {self._server.max_body} bytes", "request_too_large",
                     linger=not self._expects_continue)

    @property
    def idle(self) -> bool:
        return not self._busy and not self._queue


def _drop_cancellation(task: asyncio.Task[None]) -> None:
    """Let a cancelled connection task (its client went away) free its CancelledError now. Until someone asks for
    it, the task keeps the error; its traceback's frames hold the connection, and the connection holds the task: a
    reference cycle per connection, which only a full collection frees. A thousand queued clients leaving at once
    left 20,000-88,000 such objects and paused the gateway's loop for 37-168 ms (docs/priority.md)."""
    if task.cancelled():
        try:
            task.result()  # hands the kept error over (and forgets it): dropped here
        except asyncio.CancelledError:
            return
