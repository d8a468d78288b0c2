"""Writing a response: whole, or streamed with chunked encoding and write back-pressure; and the server's own refusals.

The second layer of a client connection (http_connection.Connection), over the reading one (http_request.py). A
handler returns a `Response` to be written in one call, or streams through its `Responder`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from .errors import GatewayError, overloaded
from .http_request import Request, RequestReader
from .limits import OUT_OF_DESCRIPTORS

logger = logging.getLogger(__name__)

REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


@dataclass(frozen=True, slots=True)
class Response:
    """A complete response, written in one call."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class Responder:
    """Writes one request's response: either returned whole by the handler, or streamed through here."""

    __slots__ = ("_conn", "_request", "headers", "started", "_head", "_ended")

    def __init__(self, conn: ResponseWriter, request: Request) -> None:
        self._conn = conn
        self._request = request
        self.headers: dict[str, str] = {}  # added to whatever response goes out (the request id)
        self.started = False
        self._head = b""
        self._ended = False  # the body's end went out with its last chunk

    @property
    def client_gone(self) -> bool:
        return self._conn.closing

    def start(self, status: int, headers: dict[str, str], content_type: str) -> None:
        """Begin a streamed response; the head goes out with the first chunk."""
        self.started = True
        self._head = self._conn.head(self._request, status, content_type, {**headers, **self.headers}, None)

    def _framed(self, data: bytes) -> bytes:
        """A chunk as it goes on the wire: chunked encoding for HTTP/1.1 (nothing for an empty one: that would end
        the body), the bytes alone for HTTP/1.0."""
        if self._request.http11:
            return b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        return data

    async def send(self, data: bytes, last: bool = False) -> None:
        """One chunk of a streamed response; waits while the client reads slower than we write. `last`: the body
        ends with it, in the same write (a stream that arrived whole goes out in one write, head to end)."""
        if not self._request.http11:
            wire = self._head + data
        elif data:  # head, chunk and end joined: one copy of the data, not one per step
            wire = b"".join((self._head, b"%x\r\n" % len(data), data, b"\r\n0\r\n\r\n" if last else b"\r\n"))
        else:  # an empty chunk would end the body
            wire = self._head + self._tail() if last else self._head
        self._head = b""
        self._ended = self._ended or last
        await self._conn.write(wire)

    def _tail(self) -> bytes:
        return b"0\r\n\r\n" if self._request.http11 else b""

    def send_now(self, data: bytes) -> bool:
        """One chunk, written at once if the client is keeping up; False (nothing written) where `send` must wait
        for it, or raise because it went away."""
        if self._head:
            return False
        return self._conn.write_now(self._framed(data))

    def chunked_target(self) -> ResponseWriter | None:
        """The client connection, once the head has gone, where the body is in chunked encoding (HTTP/1.1): a
        replica's chunks can then be written to its `open_transport` as they came."""
        return self._conn if self.started and not self._head and self._request.http11 else None

    async def finish(self) -> None:
        """End a streamed response (the head too, if no chunk was sent), unless its last chunk ended it."""
        if not self._ended:
            data, self._head, self._ended = self._head + self._tail(), b"", True
            await self._conn.write(data)
        if not self._request.http11:
            self._conn.close()  # an HTTP/1.0 stream ends when the connection does


Handler = Callable[[Request, Responder], Awaitable["Response | None"]]


class ResponseWriter(RequestReader):
    """Runs the handler for a request and writes its response; writes the server's own error answers."""

    _drain: asyncio.Future[None] | None
    _paused_at: float | None
    closing: bool
    open_transport: asyncio.Transport | None  # while a write goes out at once (http_connection.Connection)

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
                 % (status, REASONS.get(status, b"Unknown"), content_type.encode("latin-1"), self._server.date())]
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

    def write_now(self, data: bytes) -> bool:
        """Write if the client is reading (no back-pressure) and still there; else False and nothing written."""
        if self.closing or self._transport is None or self._paused_at is not None:
            return False
        self._transport.write(data)
        return True

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
                  b"Connection: close\r\n%b\r\n%b" % (status, REASONS[status], len(body), extra, body))
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
