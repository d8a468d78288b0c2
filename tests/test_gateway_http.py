"""HTTP behaviour of the gateway's own server (server.py) and replica client (upstream.py), over real sockets.

Raw asyncio streams drive what a well-behaved client library would never send (pipelining, malformed requests,
half-sent bodies); aiohttp's client is used where an ordinary client is the point. Replica-side tests use either
the FAKE replica (tests/fake_replica.py) or a scripted raw replica below that answers exactly the bytes a test gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import socket
import ssl
import struct
import subprocess
import time
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import pytest
from aiohttp import web

from gateway import server as server_module
from gateway.http_connection import Connection
from gateway.http_response import ResponseWriter
from gateway.server import HttpServer, Request, Responder, Response
from gateway.upstream import Origin, UpstreamPool, UpstreamResponse
from tests.conftest import FakeFactory, GatewayFactory
from tests.fake_replica import FakeBehavior
from tests.fake_replica import make_app as make_fake

TIMEOUT_S = 2.0  # no single exchange in this file should come near this
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
ServerHandler = Callable[[Request, Responder], Awaitable["Response | None"]]


# -- a raw HTTP client: enough to read exactly what the server wrote ----------------------------------------------
@dataclass(frozen=True)
class Reply:
    """One response as read off the wire."""

    status: int
    headers: dict[str, str]
    body: bytes
    head: bytes


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


async def read_reply(reader: asyncio.StreamReader, *, head_only: bool = False) -> Reply:
    """One response: its body by Content-Length, by chunks, or (neither) up to the connection's close."""
    async with asyncio.timeout(TIMEOUT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        status, headers = parse_head(head)
        if head_only or 100 <= status < 200:
            body = b""
        elif "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                parts.append((await reader.readexactly(size + 2))[:-2])
            assert await reader.readexactly(2) == b"\r\n"
            body = b"".join(parts)
        else:
            body = await reader.read()
    return Reply(status, headers, body, head)


async def read_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything left until the server closes the connection (fails the test if it does not)."""
    async with asyncio.timeout(TIMEOUT_S):
        return await reader.read()


@contextlib.asynccontextmanager
async def connect(port: int, rcvbuf: int | None = None
                  ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw client connection, closed at the end."""
    if rcvbuf is None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    else:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # no autotuning: a really small window
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        except OSError:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def assert_openai_error(body: bytes, status: int) -> dict[str, Any]:
    error = json.loads(body)
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["message"]
    assert error["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return error["error"]  # type: ignore[no-any-return]


# -- the server under test ----------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def serving(handler: ServerHandler, *, max_body: int = 1024, keepalive_s: float = 75.0,
                  discard_s: float = 5.0) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(handler, max_body, keepalive_s=keepalive_s, discard_s=discard_s)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.close(0)
        await asyncio.sleep(0.01)  # let the closed connections' connection_lost run


@dataclass
class Echo:
    """A handler that answers with what it saw, and records the requests in order."""

    seen: list[Request] = field(default_factory=list)
    delays: dict[str, float] = field(default_factory=dict)

    async def __call__(self, request: Request, responder: Responder) -> Response:
        self.seen.append(request)
        await asyncio.sleep(self.delays.get(request.path, 0.0))
        body = json.dumps({"method": request.method, "path": request.path, "size": len(request.body)}).encode()
        return Response(200, body)


GET = b"GET %b HTTP/1.1\r\nHost: t\r\n\r\n"


async def test_pipelined_requests_are_answered_in_order() -> None:
    """Two requests sent in one write both get answers, the slow first one before the fast second one."""
    echo = Echo(delays={"/slow": 0.1})
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/slow" + GET % b"/fast")
        first, second = await read_reply(reader), await read_reply(reader)
    assert (first.status, second.status) == (200, 200)
    assert json.loads(first.body)["path"] == "/slow"
    assert json.loads(second.body)["path"] == "/fast"
    assert [r.path for r in echo.seen] == ["/slow", "/fast"]


async def test_many_pipelined_requests_are_all_answered_in_order() -> None:
    """More pipelined requests than the server queues before it stops reading are all answered, in order."""
    echo = Echo()
    count = 3 * server_module._MAX_PIPELINED
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(b"".join(GET % b"/p%d" % i for i in range(count)))
        replies = [await read_reply(reader) for _ in range(count)]
    assert [json.loads(r.body)["path"] for r in replies] == [f"/p{i}" for i in range(count)]


async def test_http11_connection_close_is_honoured() -> None:
    """An HTTP/1.1 request with `Connection: close` is answered with `Connection: close`, then the server closes."""
    async with serving(Echo()) as (_, port), connect(port) as (reader, writer):
        writer.write(b"GET /bye HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        reply = await read_reply(reader)
        assert await read_eof(reader) == b""
    assert reply.status == 200 and reply.headers["connection"] == "close"


async def test_chunked_request_body_is_joined() -> None:
    """A chunked body sent in pieces over several writes reaches the handler whole."""
    echo = Echo()
    pieces = [b"hello ", b"chunked ", b"world" * 20]
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(b"POST /up?x=1 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nX-Mixed-Case: Yes\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        reply = await read_reply(reader)
    assert reply.status == 200
    (request,) = echo.seen
    assert request.body == b"".join(pieces)
    assert (request.method, request.path, request.target) == ("POST", "/up", "/up?x=1")
    assert request.headers["x-mixed-case"] == "Yes"


async def test_expect_100_continue_before_the_body() -> None:
    """With `Expect: 100-continue` the server says 100 Continue before the client sends the body."""
    echo = Echo()
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        async with asyncio.timeout(TIMEOUT_S):
            interim = await reader.readuntil(b"\r\n\r\n")
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert not echo.seen
        writer.write(b"12345")
        reply = await read_reply(reader)
    assert reply.status == 200
    assert echo.seen[0].body == b"12345"


async def _stream_slowly(request: Request, responder: Responder) -> Response | None:
    if request.path != "/s":
        return Response(200, b"%d" % len(request.body), "text/plain")
    responder.start(200, {}, "text/plain")
    await responder.send(b"one")
    await asyncio.sleep(0.2)
    await responder.send(b"two")
    await responder.finish()
    return None


async def test_expect_100_continue_waits_for_the_response_in_progress() -> None:
    """A `100 Continue` for a request sent while an earlier response streams comes after that response, not inside."""
    async with serving(_stream_slowly) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/s")
        async with asyncio.timeout(TIMEOUT_S):
            await reader.readuntil(b"3\r\none\r\n")  # the head and the first chunk
        writer.write(b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        async with asyncio.timeout(TIMEOUT_S):
            rest_of_stream = await reader.readuntil(b"\r\n\r\n")
        assert rest_of_stream == b"3\r\ntwo\r\n0\r\n\r\n"
        writer.write(b"12345")
        interim = await read_reply(reader)
        final = await read_reply(reader)
    assert interim.status == 100
    assert final.status == 200 and final.body == b"5"


async def test_expect_100_continue_too_large_gets_413_without_100() -> None:
    """A declared length over the limit with `Expect: 100-continue` gets a 413 (no 100 first) and a close."""
    echo = Echo()
    async with serving(echo, max_body=1024) as (_, port), connect(port) as (reader, writer):
        writer.write(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 4096\r\nExpect: 100-continue\r\n\r\n")
        reply = await read_reply(reader)
        assert reply.head.startswith(b"HTTP/1.1 413 ")
        assert await read_eof(reader) == b""
    assert assert_openai_error(reply.body, 413)["code"] == "request_too_large"
    assert not echo.seen


async def _chunks(size: int, count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield b"x" * size
        await asyncio.sleep(0)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_over_limit_is_413_the_client_reads(chunked: bool) -> None:
    """A body far over the limit (declared, or chunked and growing) gets a readable 413, not a reset."""
    echo = Echo()
    size, count = 64 * 1024, 8  # 512 KiB: more than the socket buffers hold if the server stopped reading
    async with serving(echo, max_body=1024) as (_, port), aiohttp.ClientSession() as session:
        data: bytes | AsyncIterator[bytes] = _chunks(size, count) if chunked else b"x" * (size * count)
        async with session.post(f"http://127.0.0.1:{port}/up", data=data) as resp:
            assert resp.status == 413
            body = await resp.read()
            sent_chunked = resp.request_info.headers.get("Transfer-Encoding") == "chunked"
    assert sent_chunked == chunked
    error = assert_openai_error(body, 413)
    assert error["code"] == "request_too_large" and "1024" in error["message"]
    assert not echo.seen


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_over_limit_sent_whole_before_reading_gets_413(chunked: bool) -> None:
    """A client sending all of an over-limit body before reading still gets the 413: the server drains, not resets."""
    echo = Echo()
    size, count = 64 * 1024, 16  # 1 MiB: far more than the socket buffers hold
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % (size * count)
    async with serving(echo, max_body=1024) as (_, port), connect(port) as (reader, writer):
        writer.write(b"POST /up HTTP/1.1\r\nHost: t\r\n%b\r\n\r\n" % framing)
        for _ in range(count):
            writer.write(b"%x\r\n%b\r\n" % (size, b"x" * size) if chunked else b"x" * size)
            await asyncio.wait_for(writer.drain(), TIMEOUT_S)
        writer.write(b"0\r\n\r\n" if chunked else b"")
        await asyncio.sleep(0.05)  # let a reset, if any, arrive before reading
        reply = await read_reply(reader)
        assert await read_eof(reader) == b""
    assert reply.status == 413
    assert_openai_error(reply.body, 413)
    assert not echo.seen


async def test_over_limit_body_never_sent_is_given_up_after_discard_s() -> None:
    """A client that declares an over-limit body and never sends it gets its 413, then a close after discard_s."""
    async with serving(Echo(), max_body=1024, discard_s=0.2) as (_, port), connect(port) as (reader, writer):
        writer.write(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 4096\r\n\r\n")
        reply = await read_reply(reader)
        answered = time.monotonic()
        assert await read_eof(reader) == b""
        waited = time.monotonic() - answered
    assert reply.status == 413
    assert 0.15 <= waited < 1.0


async def test_chunked_body_over_limit_raw() -> None:
    """A chunked body crossing the limit mid-stream: 413, the rest is read and dropped, then the server closes."""
    echo = Echo()
    async with serving(echo, max_body=1000) as (_, port), connect(port) as (reader, writer):
        writer.write(b"POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(5):
            writer.write(b"190\r\n" + b"y" * 0x190 + b"\r\n")  # 400 bytes a chunk: over 1000 on the third
            await writer.drain()
        reply = await read_reply(reader)
        writer.write(b"0\r\n\r\n")
        assert await read_eof(reader) == b""
    assert reply.status == 413 and reply.headers["connection"] == "close"
    assert_openai_error(reply.body, 413)
    assert not echo.seen


@pytest.mark.parametrize("raw", [
    b"NOT A REQUEST\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: ten\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef",
    # found by fuzzing: llhttp takes these request lines, and the gateway forwarded them as HTTP/1.1
    b"GET /v1/models\r\n\r\n",
    b"PRI /v1/x\r\n\r\n",
    b"GET /v1/models HTTP/2.0\r\nHost: t\r\n\r\n",
], ids=["request-line", "header", "content-length", "length-and-chunked", "two-lengths", "http-0.9", "pri-0.9",
        "http-2.0"])
async def test_malformed_request_is_400_and_closed(raw: bytes) -> None:
    """Malformed HTTP gets a 400 with an OpenAI-style body, then the connection is closed."""
    echo = Echo()
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(raw)
        reply = await read_reply(reader)
        assert await read_eof(reader) == b""
    assert reply.status == 400 and reply.headers["connection"] == "close"
    assert_openai_error(reply.body, 400)
    assert not echo.seen


def _big_heads() -> dict[str, bytes]:
    over = 2 * server_module._MAX_HEAD  # well over: how the bound counts a head's bytes is the server's business
    many = b"".join(b"X-Pad-%d: %b\r\n" % (i, b"p" * 1000) for i in range(over // 1000))
    return {"one-header": b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * over + b"\r\n\r\n",
            "many-headers": b"GET / HTTP/1.1\r\nHost: t\r\n" + many + b"\r\n",
            "url": b"GET /" + b"u" * over + b" HTTP/1.1\r\nHost: t\r\n\r\n"}


@pytest.mark.parametrize("piece", [0, 4096], ids=["one-write", "pieces"])
@pytest.mark.parametrize("kind", ["one-header", "many-headers", "url"])
async def test_head_over_the_bound_is_431(kind: str, piece: int) -> None:
    """A request head over the server's bound (one long header, many headers, a long URL) gets 431 and a close."""
    raw, echo = _big_heads()[kind], Echo()
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        with contextlib.suppress(ConnectionError):  # the server may close before the whole head is sent
            for start in range(0, len(raw), piece or len(raw)):
                writer.write(raw[start:start + (piece or len(raw))])
                await writer.drain()
        reply = await read_reply(reader)
        try:
            rest = await read_eof(reader)
        except ConnectionResetError:  # closed with the rest of the head unread: Linux resets, after the 431
            rest = b""
    assert rest == b""
    assert reply.status == 431 and reply.headers["connection"] == "close"
    assert assert_openai_error(reply.body, 431)["code"] == "request_header_fields_too_large"
    assert not echo.seen


async def test_large_bodies_and_many_pipelined_requests_are_not_taken_for_a_large_head() -> None:
    """A small head with a 1 MiB body, and pipelined requests adding up past the head bound, are served normally."""
    echo = Echo()
    size = 1024 * 1024
    pad = b"X-Pad: " + b"p" * 2000 + b"\r\n"
    count = server_module._MAX_HEAD // len(pad) + 4
    async with serving(echo, max_body=4 * size) as (_, port), connect(port) as (reader, writer):
        writer.write(b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%b" % (size, b"x" * size))
        big = await read_reply(reader)
        writer.write(b"".join(b"GET /p%d HTTP/1.1\r\nHost: t\r\n%b\r\n" % (i, pad) for i in range(count)))
        replies = [await read_reply(reader) for _ in range(count)]
    assert big.status == 200 and json.loads(big.body)["size"] == size
    assert [json.loads(r.body)["path"] for r in replies] == [f"/p{i}" for i in range(count)]


UPGRADE = b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


async def test_upgrade_is_400_and_closed() -> None:
    """A protocol upgrade request gets a 400 with an OpenAI-style body, then the connection is closed."""
    async with serving(Echo()) as (_, port), connect(port) as (reader, writer):
        writer.write(UPGRADE)
        reply = await read_reply(reader)
        assert await read_eof(reader) == b""
    assert reply.status == 400 and reply.headers["connection"] == "close"
    assert assert_openai_error(reply.body, 400)["code"] == "upgrade_not_supported"


async def test_refused_upgrade_is_not_dispatched() -> None:
    """The handler never sees a request the server refused as an upgrade."""
    echo = Echo()
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(UPGRADE)
        await read_eof(reader)
        await asyncio.sleep(0.05)
    assert not echo.seen


async def test_malformed_request_behind_a_valid_one_answers_the_valid_one_first() -> None:
    """A valid request followed by garbage in one write: the valid one is answered, then 400, then close."""
    echo = Echo(delays={"/ok": 0.05})
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/ok" + b"NOT A REQUEST\r\n\r\n")
        first = await read_reply(reader)
        rest = await read_eof(reader)
    assert first.status == 200 and json.loads(first.body)["path"] == "/ok"
    assert rest.startswith(b"HTTP/1.1 400 ")


async def test_too_large_request_behind_a_valid_one_answers_the_valid_one_first() -> None:
    """A valid request followed by an over-limit one: the valid one is answered first, then 413."""
    echo = Echo(delays={"/ok": 0.05})
    async with serving(echo, max_body=10) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/ok" + b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"z" * 100)
        first = await read_reply(reader)
        rest = await read_eof(reader)
    assert first.status == 200 and json.loads(first.body)["path"] == "/ok"
    assert rest.startswith(b"HTTP/1.1 413 ")


async def test_head_has_length_and_no_body() -> None:
    """HEAD gets the GET answer's headers (Content-Length included) and no body: the next answer follows at once."""
    async def handler(request: Request, responder: Responder) -> Response:
        return Response(200, b"hello", "text/plain")

    async with serving(handler) as (_, port), connect(port) as (reader, writer):
        writer.write(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n" + GET % b"/x")
        head = await read_reply(reader, head_only=True)
        get = await read_reply(reader)
    assert head.status == 200 and head.headers["content-length"] == "5"
    assert head.headers["content-type"] == "text/plain"
    assert get.status == 200 and get.body == b"hello"


async def test_http10_is_answered_then_closed() -> None:
    """An HTTP/1.0 request without keep-alive is answered with a length, then the connection is closed."""
    echo = Echo()
    async with serving(echo) as (_, port), connect(port) as (reader, writer):
        writer.write(b"GET /old HTTP/1.0\r\n\r\n")
        reply = await read_reply(reader)
        assert await read_eof(reader) == b""
    assert reply.status == 200 and reply.headers["connection"] == "close"
    assert json.loads(reply.body)["path"] == "/old"
    assert echo.seen[0].http11 is False and echo.seen[0].keep_alive is False


async def test_http10_keep_alive_is_honoured() -> None:
    """HTTP/1.0 asking for keep-alive gets `Connection: keep-alive` and a second answer on the same socket."""
    echo = Echo()
    request = b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    async with serving(echo) as (server, port), connect(port) as (reader, writer):
        writer.write(request)
        first = await read_reply(reader)
        writer.write(request)
        second = await read_reply(reader)
        assert len(server.connections) == 1
    assert first.headers["connection"].lower() == "keep-alive" and "content-length" in first.headers
    assert second.status == 200


async def _stream_three(request: Request, responder: Responder) -> None:
    responder.start(200, {"x-streamed": "yes"}, "text/event-stream")
    for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
        await responder.send(part)
    await responder.finish()


@pytest.mark.parametrize("keep_alive", [False, True])
async def test_http10_stream_is_unchunked_and_ends_at_close(keep_alive: bool) -> None:
    """A streamed answer to HTTP/1.0 has no chunked encoding and no length: its body ends when the server closes."""
    ask = b"Connection: keep-alive\r\n" if keep_alive else b""
    async with serving(_stream_three) as (_, port), connect(port) as (reader, writer):
        writer.write(b"GET /s HTTP/1.0\r\n" + ask + b"\r\n")
        reply = await read_reply(reader)  # neither length nor chunks: reads to EOF
    assert reply.status == 200
    assert "transfer-encoding" not in reply.headers and "content-length" not in reply.headers
    assert reply.headers["connection"] == "close" and reply.headers["x-streamed"] == "yes"
    assert reply.body == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"


async def test_http11_stream_is_chunked_and_keeps_the_connection() -> None:
    """A streamed answer to HTTP/1.1 is chunked, and the connection serves the next request."""
    async with serving(_stream_three) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/s")
        first = await read_reply(reader)
        writer.write(GET % b"/s")
        second = await read_reply(reader)
    assert first.headers["transfer-encoding"] == "chunked"
    assert first.body == second.body == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"


async def test_keep_alive_reuses_one_connection() -> None:
    """An ordinary client's sequential requests all travel on one connection."""
    created: list[object] = []

    async def on_create(session: aiohttp.ClientSession, ctx: object, params: object) -> None:
        created.append(params)

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_create)
    echo = Echo()
    async with serving(echo) as (server, port), aiohttp.ClientSession(trace_configs=[trace]) as session:
        for i in range(5):
            async with session.post(f"http://127.0.0.1:{port}/n", data=b"x" * i) as resp:
                assert resp.status == 200
                assert (await resp.json())["size"] == i
        assert len(server.connections) == 1
    assert len(created) == 1
    assert len(echo.seen) == 5


async def test_idle_keep_alive_connection_is_closed() -> None:
    """A connection quiet for keepalive_s after its answer is closed by the server."""
    async with serving(Echo(), keepalive_s=0.2) as (server, port), connect(port) as (reader, writer):
        writer.write(GET % b"/a")
        assert (await read_reply(reader)).status == 200
        answered = time.monotonic()
        assert await read_eof(reader) == b""
        waited = time.monotonic() - answered
        await asyncio.sleep(0.01)
        assert not server.connections
    assert 0.15 <= waited < 1.0


async def test_silent_connection_is_closed() -> None:
    """A connection that never sends a request is closed after keepalive_s."""
    async with serving(Echo(), keepalive_s=0.2) as (_, port), connect(port) as (reader, _writer):
        started = time.monotonic()
        assert await read_eof(reader) == b""
    assert 0.15 <= time.monotonic() - started < 1.0


async def test_busy_connection_outlives_keepalive() -> None:
    """A handler running longer than keepalive_s is not cut off by the idle timer."""
    echo = Echo(delays={"/slow": 0.5})
    async with serving(echo, keepalive_s=0.1) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/slow")
        reply = await read_reply(reader)
    assert reply.status == 200 and json.loads(reply.body)["path"] == "/slow"


@dataclass
class Sleeper:
    """A handler that sleeps; it records that it started, finished or was cancelled."""

    sleep_s: float
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, request: Request, responder: Responder) -> Response:
        self.started.set()
        try:
            await asyncio.sleep(self.sleep_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished.set()
        return Response(200, b'{"slept": true}')


async def test_client_disconnect_cancels_the_handler() -> None:
    """A client that goes away mid-request cancels its handler at once."""
    sleeper = Sleeper(10.0)
    async with serving(sleeper) as (_, port):
        async with connect(port) as (_reader, writer):
            writer.write(GET % b"/sleep")
            await asyncio.wait_for(sleeper.started.wait(), TIMEOUT_S)
        await asyncio.wait_for(sleeper.cancelled.wait(), 1.0)
    assert not sleeper.finished.is_set()


async def test_a_client_gone_mid_request_leaves_no_cycle_for_the_collector() -> None:
    """Neither the cancelled handler's error nor the connection waits for a full collection: the task drops its
    error, and the lost connection its parser's callbacks (a thousand clients leaving at once left tens of
    thousands of objects in cycles and paused the loop, docs/priority.md)."""
    sleeper = Sleeper(10.0)
    gc.collect()
    gc.disable()
    try:
        async with serving(sleeper) as (_, port):
            for _ in range(3):
                sleeper.started.clear()
                sleeper.cancelled.clear()
                async with connect(port) as (_reader, writer):
                    writer.write(GET % b"/sleep")
                    await asyncio.wait_for(sleeper.started.wait(), TIMEOUT_S)
                await asyncio.wait_for(sleeper.cancelled.wait(), 1.0)
            await asyncio.sleep(0.05)  # the connection tasks finish and run their callbacks
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = [o for o in gc.garbage if isinstance(o, (asyncio.CancelledError, Connection))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


async def test_client_disconnect_cancels_a_stream_blocked_on_backpressure() -> None:
    """A streaming handler waiting for a client that stopped reading is cancelled when that client goes away."""
    cancelled = asyncio.Event()
    sent = 0
    most = 1024  # 64 MiB: bounded, so that a server without back-pressure fails the test rather than hangs it

    async def flood(request: Request, responder: Responder) -> None:
        nonlocal sent
        responder.start(200, {}, "application/octet-stream")
        try:
            for _ in range(most):
                await responder.send(b"f" * 65536)
                sent += 1
                await asyncio.sleep(0)
            await responder.finish()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with serving(flood) as (_, port):
        async with connect(port, rcvbuf=16384) as (_reader, writer):
            writer.write(GET % b"/flood")
            await asyncio.sleep(0.3)  # the handler fills the buffers and blocks
            blocked_at = sent
            await asyncio.sleep(0.1)
            assert 0 < sent == blocked_at < most  # blocked, not buffering without bound
        await asyncio.wait_for(cancelled.wait(), 1.0)


async def test_graceful_close_lets_a_request_finish() -> None:
    """A request in flight at close finishes within the grace period, and close returns soon after."""
    sleeper = Sleeper(0.2)
    async with serving(sleeper) as (server, port), connect(port) as (reader, writer):
        writer.write(GET % b"/sleep")
        await asyncio.wait_for(sleeper.started.wait(), TIMEOUT_S)
        started = time.monotonic()
        closing = asyncio.create_task(server.close(5.0))
        reply = await read_reply(reader)
        await asyncio.wait_for(closing, TIMEOUT_S)
        took = time.monotonic() - started
        assert await read_eof(reader) == b""
    assert reply.status == 200 and reply.body == b'{"slept": true}'
    assert took < 1.0
    assert sleeper.finished.is_set() and not sleeper.cancelled.is_set()


async def test_graceful_close_cancels_a_request_past_grace() -> None:
    """A request still running when the grace period ends is cancelled and its client sees the close."""
    sleeper = Sleeper(10.0)
    async with serving(sleeper) as (server, port), connect(port) as (reader, writer):
        writer.write(GET % b"/sleep")
        await asyncio.wait_for(sleeper.started.wait(), TIMEOUT_S)
        started = time.monotonic()
        await asyncio.wait_for(server.close(0.2), TIMEOUT_S)
        took = time.monotonic() - started
        assert await read_eof(reader) == b""
        await asyncio.wait_for(sleeper.cancelled.wait(), 1.0)
    assert 0.15 <= took < 1.0
    assert not sleeper.finished.is_set()


async def test_graceful_close_closes_idle_connections_at_once() -> None:
    """Idle connections (after an answer, or before any request) close at once; the port stops accepting."""
    async with (serving(Echo()) as (server, port), connect(port) as (used_reader, used_writer),
                connect(port) as (silent_reader, _)):
        used_writer.write(GET % b"/a")
        assert (await read_reply(used_reader)).status == 200
        started = time.monotonic()
        await asyncio.wait_for(server.close(5.0), TIMEOUT_S)
        took = time.monotonic() - started
        assert await read_eof(used_reader) == b""
        assert await read_eof(silent_reader) == b""
        with pytest.raises(ConnectionRefusedError):
            async with connect(port):
                pass
    assert took < 0.5


async def test_slow_reader_gets_a_large_stream_whole() -> None:
    """A stream larger than the socket buffers reaches a client that reads late and slowly, complete and in order."""
    chunks = [bytes([i % 251]) * 65536 for i in range(128)]  # 8 MiB: more than loopback's buffers hold
    done = asyncio.Event()

    async def big(request: Request, responder: Responder) -> None:
        responder.start(200, {}, "application/octet-stream")
        for chunk in chunks:
            await responder.send(chunk)
        await responder.finish()
        done.set()

    async with serving(big) as (_, port), connect(port, rcvbuf=65536) as (reader, writer):
        writer.write(GET % b"/big")
        await asyncio.sleep(0.3)
        assert not done.is_set()  # write back-pressure holds the handler while the client reads nothing
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
        assert parse_head(head)[1]["transfer-encoding"] == "chunked"
        received = []
        async with asyncio.timeout(5.0):
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                received.append((await reader.readexactly(size + 2))[:-2])
                if len(received) % 16 == 0:
                    await asyncio.sleep(0.01)  # slow reader
            await reader.readexactly(2)
        await asyncio.wait_for(done.wait(), TIMEOUT_S)
    assert b"".join(received) == b"".join(chunks)


async def test_handler_error_is_500_and_the_connection_serves_on() -> None:
    """A handler that raises gets the client an OpenAI-style 500, and the next request on the connection works."""
    async def flaky(request: Request, responder: Responder) -> Response:
        if request.path == "/boom":
            raise RuntimeError("boom")
        return Response(200, b"{}")

    async with serving(flaky) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/boom" + GET % b"/fine")
        boom, fine = await read_reply(reader), await read_reply(reader)
    assert boom.status == 500
    assert assert_openai_error(boom.body, 500)["code"] == "internal_error"
    assert fine.status == 200


# -- a scripted raw replica ----------------------------------------------------------------------------------------
# what to send (parts: with a pause between), and then: keep the connection (False), close it (True), or reset it
Answer = tuple["bytes | tuple[bytes, ...]", "bool | Literal['reset']"]
Script = Callable[[str, str, int], "Answer | None"]  # (method, path, n-th request on its connection); None: close

MODELS = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
COMPLETION = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "fake-model",
                         "choices": [{"index": 0, "text": " tok", "finish_reason": "length"}]}).encode()


def answer(body: bytes, status: str = "200 OK", content_type: bytes = b"application/json",
           extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %b\r\nContent-Type: %b\r\nContent-Length: %d\r\n%b\r\n%b"
            % (status.encode(), content_type, len(body), extra, body))


class RawReplica:
    """A replica that answers /health and /v1/models properly and everything else as its script says."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.seen: list[tuple[int, str]] = []  # (connection number, path)
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.url = ""

    def connections(self, path: str = "/v1/completions") -> list[int]:
        """The connection numbers that carried requests for `path`, in order, without repeats."""
        return list(dict.fromkeys(c for c, p in self.seen if p == path))

    async def start(self, tls: ssl.SSLContext | None = None) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=tls)
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = next(self._ids)
        try:
            for n in itertools.count():
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.seen.append((conn, path))
                if path == "/health":
                    reply: Answer | None = (answer(b""), False)
                elif path == "/v1/models":
                    reply = (answer(MODELS), False)
                else:
                    reply = self.script(method, path, n)
                if reply is None:
                    return
                parts = reply[0] if isinstance(reply[0], tuple) else (reply[0],)
                for i, part in enumerate(parts):
                    await asyncio.sleep(0.05 if i else 0)
                    writer.write(part)
                    await writer.drain()
                if reply[1] == "reset":
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if reply[1]:
                    return
        finally:
            self._tasks.discard(task)
            writer.close()


class RawFactory(Protocol):
    def __call__(self, script: Script, tls: ssl.SSLContext | None = None) -> Awaitable[RawReplica]: ...


@pytest.fixture
async def raw_replica() -> AsyncIterator[RawFactory]:
    """Start scripted raw replicas: `await raw_replica(script)`."""
    replicas: list[RawReplica] = []

    async def start(script: Script, tls: ssl.SSLContext | None = None) -> RawReplica:
        replica = RawReplica(script)
        await replica.start(tls)
        replicas.append(replica)
        return replica

    yield start
    for replica in replicas:
        await replica.close()


async def post_completion(session: aiohttp.ClientSession, url: str, **extra: Any) -> tuple[int, bytes]:
    async with session.post(url + "/v1/completions", json={**BODY, **extra}) as resp:
        return resp.status, await resp.read()


async def metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


# -- the upstream pool, through the gateway -----------------------------------------------------------------------
async def test_sequential_requests_share_one_upstream_connection(aiohttp_server: Any,
                                                                 gateway_for: GatewayFactory) -> None:
    """Sequential requests, streamed and not, reach the fake replica over one pooled connection."""
    app = make_fake(FakeBehavior())
    peers: list[int] = []

    @web.middleware
    async def record_peer(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/completions") and request.transport is not None:
            peers.append(request.transport.get_extra_info("peername")[1])
        return await handler(request)  # type: ignore[no-any-return]

    app.middlewares.append(record_peer)
    fake = await aiohttp_server(app)
    url = str(fake.make_url("")).rstrip("/")
    gw = await gateway_for([url])
    async with aiohttp.ClientSession() as session:
        for i in range(6):
            status, body = await post_completion(session, gw.url, stream=i % 2 == 1)
            assert status == 200, body
            if i % 2:
                assert body.endswith(b"data: [DONE]\n\n")
    assert len(peers) == 6
    assert len(set(peers)) == 1


async def test_replica_closing_idle_connections_is_harmless(aiohttp_server: Any,
                                                            gateway_for: GatewayFactory) -> None:
    """A replica that closes idle keep-alive connections quickly costs neither a failed request nor an ejection."""
    app = make_fake(FakeBehavior())
    fake = await aiohttp_server(app, keepalive_timeout=0.05)
    url = str(fake.make_url("")).rstrip("/")
    gw = await gateway_for([url])
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            status, body = await post_completion(session, gw.url)
            assert status == 200, body
            await asyncio.sleep(0.15)  # the replica closes the pooled connection meanwhile
        metrics = await metrics_text(session, gw.url)
    assert gw.gateway.router.replicas[url].healthy
    assert "gateway_retries_total{" not in metrics


async def test_pooled_connection_closed_as_it_is_reused_is_retried(raw_replica: RawFactory,
                                                                   gateway_for: GatewayFactory) -> None:
    """A replica that closes a kept-alive connection on receiving the next request: the pool retries it afresh."""
    replica = await raw_replica(lambda method, path, n: (answer(COMPLETION), False) if n == 0 else None)
    gw = await gateway_for([replica.url])
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            status, body = await post_completion(session, gw.url)
            assert status == 200 and body == COMPLETION
        metrics = await metrics_text(session, gw.url)
    assert len(replica.connections()) == 3  # each reuse was refused and retried once on a new connection
    assert sum(p == "/v1/completions" for _, p in replica.seen) == 5
    assert gw.gateway.router.replicas[replica.url].healthy
    assert "gateway_retries_total{" not in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_answer_ending_at_close_is_relayed_whole(raw_replica: RawFactory, gateway_for: GatewayFactory,
                                                       stream: bool) -> None:
    """An answer with neither length nor chunking (its body ends at the close) reaches the client whole."""
    if stream:
        content_type = b"text/event-stream"
        events = b"".join(b'data: {"n": %d, "pad": "%b"}\n\n' % (i, b"p" * 1000) for i in range(300))
        body = events + b"data: [DONE]\n\n"
    else:
        content_type = b"application/json"
        body = json.dumps({"object": "text_completion", "pad": "q" * 600_000}).encode()  # past the pool's pause mark
    head = b"HTTP/1.1 200 OK\r\nContent-Type: %b\r\n\r\n" % content_type
    replica = await raw_replica(lambda method, path, n: (head + body, True))
    gw = await gateway_for([replica.url])
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            status, got = await post_completion(session, gw.url, stream=stream)
            assert status == 200
            assert got == body
    assert len(replica.connections()) == 2  # an answer that ended with its connection is not pooled
    assert gw.gateway.router.replicas[replica.url].healthy


@pytest.mark.parametrize("split", [False, True], ids=["whole", "in-two-parts"])
async def test_streamed_answer_ends_in_the_write_of_its_last_chunk(raw_replica: RawFactory,
                                                                    gateway_for: GatewayFactory,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    split: bool) -> None:
    """The end of a streamed body (HTTP/1.1's last chunk) goes out with the events before it: a stream the replica
    sent whole reaches the client in one write, one sent in two parts in two; both read back whole, twice over one
    connection (an end written twice would corrupt the next answer)."""
    first, rest = b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = [b"%x\r\n%b\r\n" % (len(part), part) for part in (first, rest)]
    parts = (head + chunks[0], chunks[1] + b"0\r\n\r\n") if split else (head + b"".join(chunks) + b"0\r\n\r\n",)
    replica = await raw_replica(lambda method, path, n: (parts, False))
    gw = await gateway_for([replica.url])
    writes: list[bytes] = []
    original = ResponseWriter.write

    async def counted(self: ResponseWriter, data: bytes) -> None:
        writes.append(data)
        await original(self, data)

    monkeypatch.setattr(ResponseWriter, "write", counted)
    monkeypatch.setattr(ResponseWriter, "write_now", lambda self, data: False)  # every chunk through `write`
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            status, got = await post_completion(session, gw.url, stream=True)
            assert status == 200 and got == first + rest
    assert len(replica.connections()) == 1
    ends = [w.endswith(b"0\r\n\r\n") for w in writes]  # per request: the writes, and which carried the end
    assert ends == ([False, True] * 2 if split else [True, True]), writes


def _chunk(data: bytes, extension: bytes = b"") -> bytes:
    return b"%x%b\r\n%b\r\n" % (len(data), extension, data)


async def test_stream_relays_the_replicas_chunks_as_they_came(raw_replica: RawFactory, gateway_for: GatewayFactory,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of one whole chunk holding whole events, after a read that ended a chunk, goes to an HTTP/1.1 client
    as the replica framed it (no parsing, no framing of our own); any other read is parsed and framed by the
    gateway, and so is every read for an HTTP/1.0 client (no chunked encoding). Either way the client gets every
    event once, in order."""
    events = [b"data: %d\n\n" % i for i in range(12)]
    events[10:10] = [b"data: 4\r\nzz\n\n"]  # its chunk's second half looks like a whole chunk ("4\r\nzz\n\n\r\n")
    split, look_alike = _chunk(events[5]), _chunk(events[10])
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    parts = (head + _chunk(events[0]),
             _chunk(events[1]),  # the first read seen by the relay: framed (where it starts is not known yet)
             _chunk(events[2]),
             _chunk(events[3], b";ext=1") + _chunk(events[4]),  # two chunks in a read, one with an extension
             split[:7], split[7:],  # a chunk cut across two reads
             _chunk(events[6][:4]), _chunk(events[6][4:]),  # an event cut across two chunks
             b"9\r\n", events[7] + b"\r\n",  # a chunk's size alone, then its data
             _chunk(events[8]), _chunk(events[9]),
             look_alike[:9], look_alike[9:],
             b"A\r\n" + events[11] + b"\r\n",  # a size in upper case
             _chunk(events[12]) + b"0\r\n\r\n")
    replica = await raw_replica(lambda method, path, n: (parts, False))
    gw = await gateway_for([replica.url])
    direct: list[int] = []  # per answer: the reads written straight to the client
    original = UpstreamResponse.splice

    def spied(self: UpstreamResponse, sink: Any, tally: Any = None) -> None:
        if sink is None:
            direct.append(self.relayed)
        original(self, sink, tally)

    monkeypatch.setattr(UpstreamResponse, "splice", spied)
    async with aiohttp.ClientSession() as session:
        status, got = await post_completion(session, gw.url, stream=True)
    assert status == 200 and got == b"".join(events)
    assert direct == [3]  # the reads of events 2, 8 and 9

    body = json.dumps({**BODY, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (len(body), body))
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.split(b"\r\n\r\n", 1)[1] == b"".join(events)  # no chunk sizes: HTTP/1.0's body is the events
    assert direct == [3, 0]  # an HTTP/1.0 client's body has no chunks to write as they came


async def test_chunks_written_as_they_came_respect_back_pressure() -> None:
    """The client's `open_transport`, which a replica connection writes whole chunks to with no call in between,
    is there only while a write goes out at once: None while the client is behind or the connection closing; and
    a whole chunk that finds it None waits for `readany`, in order, instead of being written."""
    from gateway.upstream import _Connection as Upstream
    from tests.fuzz.harness import MemoryTransport

    async def nothing(request: Request, responder: Responder) -> Response:
        return Response(200)
    client = server_module._Connection(HttpServer(nothing, 1024))
    transport = MemoryTransport(client)
    client.connection_made(transport)
    assert client.open_transport is transport
    client.pause_writing()
    assert client.open_transport is None
    client.resume_writing()
    assert client.open_transport is transport
    client.close()
    assert client.open_transport is None
    client.resume_writing()
    assert client.open_transport is None  # closing: it stays None

    class Target:
        open_transport: Any = None
    pool = UpstreamPool(connect_s=1)
    replica = Upstream(pool, Origin.from_url("http://r:80"))
    replica_side = MemoryTransport(replica)
    replica.connection_made(replica_side)
    replica.send(b"POST / HTTP/1.1\r\n\r\n")
    replica.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    response = UpstreamResponse(replica, pool)
    target = Target()
    taken: list[bytes] = []
    response.splice(lambda part, events: taken.append(part) is None)  # the sink takes what is parsed
    response.relay_to(target)
    out = MemoryTransport(client)
    for i in range(4):
        target.open_transport = out if i % 2 else None
        replica.data_received(_chunk(b"data: %d\n\n" % i))
    # 0 is parsed (nothing before it ended a chunk), 1 goes out as it came, 2 waits (the client is behind), and 3,
    # though the client has caught up, waits behind 2
    assert taken == [b"data: 0\n\n"]
    assert bytes(out.written) == _chunk(b"data: 1\n\n")
    assert await response.readany() == b"data: 2\n\ndata: 3\n\n"
    assert response.relayed == 1
    pool.close()


async def test_answer_ending_at_a_reset_is_not_taken_as_complete(raw_replica: RawFactory,
                                                                 gateway_for: GatewayFactory) -> None:
    """An unframed answer cut short by a reset is a failed answer (502), not a complete one."""
    truncated = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"object": "text_completion", "ch'
    replica = await raw_replica(lambda method, path, n: (truncated, "reset"))
    gw = await gateway_for([replica.url], retry={"max_attempts": 1, "max_time_s": 5})
    async with aiohttp.ClientSession() as session:
        status, body = await post_completion(session, gw.url)
    assert status == 502, body
    assert_openai_error(body, 502)


@pytest.mark.parametrize("reply", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    # found by fuzzing: llhttp takes any three digits as a status, and the gateway relayed "020" as "HTTP/1.1 20"
    b"HTTP/1.1 020 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 600 OK\r\nContent-Length: 0\r\n\r\n",
], ids=["status-line", "content-length", "chunk-size", "status-020", "status-600"])
async def test_malformed_replica_answer_is_502(raw_replica: RawFactory, gateway_for: GatewayFactory,
                                               reply: bytes) -> None:
    """A replica answering malformed HTTP gets the client a 502 with an OpenAI-style body."""
    replica = await raw_replica(lambda method, path, n: (reply, False))
    gw = await gateway_for([replica.url], retry={"max_attempts": 1, "max_time_s": 5})
    async with aiohttp.ClientSession() as session:
        status, body = await post_completion(session, gw.url)
    assert status == 502
    assert assert_openai_error(body, 502)["code"] == "upstream_error"


async def test_interim_100_from_the_replica_is_skipped(raw_replica: RawFactory, gateway_for: GatewayFactory) -> None:
    """A `100 Continue` ahead of the replica's answer is not mistaken for the answer."""
    parts = (b"HTTP/1.1 100 Continue\r\n\r\n", answer(COMPLETION))
    replica = await raw_replica(lambda method, path, n: (parts, False))
    gw = await gateway_for([replica.url])
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            status, body = await post_completion(session, gw.url)
            assert status == 200 and body == COMPLETION
    assert len(replica.connections()) == 1


async def test_gateway_head_on_a_get_route(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """HEAD on the gateway's GET routes is allowed: the GET answer's head, Content-Length included, and no body."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with connect(gw.port) as (reader, writer):
        writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: t\r\n\r\n" + GET % b"/v1/models")
        head = await read_reply(reader, head_only=True)
        get = await read_reply(reader)
    assert head.status == get.status == 200
    assert int(head.headers["content-length"]) == len(get.body) > 0
    assert head.headers["x-request-id"] and head.headers["x-request-id"] != get.headers["x-request-id"]
    assert json.loads(get.body)["data"][0]["id"] == "fake-model"


async def test_head_forwarded_to_a_replica_is_answered_at_once(fake_replica: FakeFactory,
                                                                gateway_for: GatewayFactory) -> None:
    """HEAD on a /v1 path the gateway forwards gets the replica's answer promptly, and the replica stays in."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], timeouts={"connect_s": 1, "first_byte_s": 0.5, "idle_s": 1},
                           retry={"max_attempts": 1, "max_time_s": 1})
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.head(gw.url + "/v1/not-a-route") as resp:
            status = resp.status
        took = time.monotonic() - started
    assert status == 404  # what the fake answers GET with
    assert took < 0.4
    assert gw.gateway.router.replicas[fake.url].healthy


# -- the upstream pool on its own ----------------------------------------------------------------------------------
def test_origin_from_url() -> None:
    """Origins get default ports and Host headers that show the port only when it is not the default."""
    assert Origin.from_url("http://replica:8001") == Origin("http", "replica", 8001, b"replica:8001")
    assert Origin.from_url("http://replica") == Origin("http", "replica", 80, b"replica")
    assert Origin.from_url("https://replica") == Origin("https", "replica", 443, b"replica")
    assert Origin.from_url("http://[::1]:9000").host_header == b"[::1]:9000"


def _get(origin: Origin, path: bytes = b"/x") -> bytes:
    return b"GET %b HTTP/1.1\r\nHost: %b\r\n\r\n" % (path, origin.host_header)


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    """A replica client pool, closed after the test."""
    pool = UpstreamPool(connect_s=1.0)
    yield pool
    pool.close()


async def get_body(pool: UpstreamPool, origin: Origin) -> bytes:
    """GET /x through the pool: the whole body, the answer closed (its connection pooled if it can be)."""
    response = await pool.request(origin, _get(origin), b"")
    try:
        return await response.read()
    finally:
        response.close()


async def test_pool_does_not_reuse_connections_idle_past_idle_s(raw_replica: RawFactory) -> None:
    """A connection idle for less than idle_s is reused; one idle longer is replaced by a new one."""
    replica = await raw_replica(lambda method, path, n: (answer(b"ok"), False))
    origin = Origin.from_url(replica.url)
    pool = UpstreamPool(connect_s=1.0, idle_s=0.2)
    try:
        for pause in (0.0, 0.0, 0.3):
            await asyncio.sleep(pause)
            response = await pool.request(origin, _get(origin), b"")
            assert (response.status, await response.read()) == (200, b"ok")
            response.close()
    finally:
        pool.close()
    assert [c for c, _ in replica.seen] == [1, 1, 2]


async def test_pool_closes_a_connection_whose_answer_was_not_read(raw_replica: RawFactory, pool: UpstreamPool) -> None:
    """An answer abandoned before its end closes its connection; the next request opens a new one."""
    replica = await raw_replica(lambda method, path, n: (answer(b"b" * 100_000), False))
    origin = Origin.from_url(replica.url)
    abandoned = await pool.request(origin, _get(origin), b"")
    assert abandoned.status == 200
    abandoned.close()
    whole = await pool.request(origin, _get(origin), b"")
    assert len(await whole.read()) == 100_000
    whole.close()
    again = await pool.request(origin, _get(origin), b"")
    assert len(await again.read()) == 100_000
    again.close()
    assert [c for c, _ in replica.seen] == [1, 2, 2]


async def test_pool_reads_a_chunked_answer_and_reuses_the_connection(raw_replica: RawFactory,
                                                                     pool: UpstreamPool) -> None:
    """A chunked answer is read piece by piece as it arrives, to its end, and its connection goes back to the pool."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
    parts = (head + b"7\r\ndata: 1\r\n", b"7\r\ndata: 2\r\n0\r\n\r\n")
    replica = await raw_replica(lambda method, path, n: (parts, False))
    origin = Origin.from_url(replica.url)
    for _ in range(2):
        response = await pool.request(origin, _get(origin), b"")
        assert response.content_type == "text/event-stream"
        assert [await response.readany() for _ in range(3)] == [b"data: 1", b"data: 2", b""]
        response.close()
    assert [c for c, _ in replica.seen] == [1, 1]


async def test_pool_skips_an_interim_100(raw_replica: RawFactory, pool: UpstreamPool) -> None:
    """A `100 Continue` arriving ahead of the answer is neither the answer's status nor its headers."""
    parts = (b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\n", answer(b"ok", extra=b"X-Final: yes\r\n"))
    replica = await raw_replica(lambda method, path, n: (parts, False))
    origin = Origin.from_url(replica.url)
    response = await pool.request(origin, _get(origin), b"")
    assert (response.status, await response.read()) == (200, b"ok")
    assert response.headers.get("x-final") == "yes" and "x-interim" not in response.headers
    response.close()


async def test_pool_does_not_reuse_a_connection_the_replica_said_to_close(raw_replica: RawFactory,
                                                                          pool: UpstreamPool) -> None:
    """An answer with `Connection: close` retires its connection even if the replica leaves the socket open."""
    replica = await raw_replica(lambda method, path, n: (answer(b"ok", extra=b"Connection: close\r\n"), False))
    origin = Origin.from_url(replica.url)
    for _ in range(2):
        assert await get_body(pool, origin) == b"ok"
    assert [c for c, _ in replica.seen] == [1, 2]


async def test_pool_reads_a_head_answer_as_bodiless(raw_replica: RawFactory, pool: UpstreamPool) -> None:
    """The answer to HEAD ends with its head, whatever Content-Length it names; the connection is reused."""
    replica = await raw_replica(lambda method, path, n: (answer(b"x" * 10)[:-10], False))  # the head alone
    origin = Origin.from_url(replica.url)
    for _ in range(2):
        response = await pool.request(origin, b"HEAD /x HTTP/1.1\r\nHost: %b\r\n\r\n" % origin.host_header, b"")
        assert response.headers["content-length"] == "10"
        async with asyncio.timeout(0.5):
            assert await response.read() == b""
        response.close()
    assert [c for c, _ in replica.seen] == [1, 1]


async def test_pool_retries_a_reused_connection_once(raw_replica: RawFactory, pool: UpstreamPool) -> None:
    """A pooled connection the replica drops on the next request is retried once on a fresh connection."""
    replica = await raw_replica(lambda method, path, n: (answer(b"ok"), False) if n == 0 else None)
    origin = Origin.from_url(replica.url)
    for _ in range(2):
        assert await get_body(pool, origin) == b"ok"
    assert [c for c, _ in replica.seen] == [1, 1, 2]


async def test_pool_does_not_retry_a_fresh_connection(raw_replica: RawFactory, pool: UpstreamPool) -> None:
    """A new connection that the replica drops without answering is an error, not a silent retry."""
    replica = await raw_replica(lambda method, path, n: None)
    origin = Origin.from_url(replica.url)
    with pytest.raises(ConnectionError):
        await pool.request(origin, _get(origin), b"")
    assert [c for c, _ in replica.seen] == [1]


@pytest.mark.parametrize("ending", ["reset", "close"])
async def test_stream_cut_inside_an_event_ends_with_a_readable_error_event(raw_replica: RawFactory,
                                                                          gateway_for: GatewayFactory,
                                                                          ending: str) -> None:
    """A replica that dies in the middle of an SSE event: the client gets the whole events, then an error event of
    its own that parses as JSON (the half event is dropped, not glued to it). Found by fuzzing."""
    whole = b'data: {"choices": [{"index": 0, "text": " tok"}]}\n\n'
    sent = whole + b'data: {"choices": [{"ind'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    replica = await raw_replica(lambda method, path, n: (head + b"%x\r\n%b\r\n" % (len(sent), sent),
                                                         "reset" if ending == "reset" else True))
    gw = await gateway_for([replica.url])
    async with aiohttp.ClientSession() as session:
        status, body = await post_completion(session, gw.url, stream=True)
    assert status == 200
    events = body.split(b"\n\n")
    assert events[0] + b"\n\n" == whole and events[-1] == b""
    error = json.loads(events[1].removeprefix(b"data: "))
    assert error["error"]["code"] == "upstream_stream_error" and len(events) == 3


async def test_stream_events_split_across_reads_arrive_whole(raw_replica: RawFactory,
                                                             gateway_for: GatewayFactory) -> None:
    """SSE events that reach the gateway in pieces (an event cut across reads) reach the client complete and in order."""
    events = [b'data: {"n": %d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]
    stream = b"".join(events)
    parts = [stream[:7], stream[7:30], stream[30:31], stream[31:]]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = tuple(b"%x\r\n%b\r\n" % (len(p), p) for p in parts)
    replica = await raw_replica(lambda method, path, n: ((head + chunks[0], *chunks[1:], b"0\r\n\r\n"), False))
    gw = await gateway_for([replica.url])
    async with aiohttp.ClientSession() as session:
        status, body = await post_completion(session, gw.url, stream=True)
    assert (status, body) == (200, stream)


async def test_events_relayed_from_the_callback_and_by_the_loop_keep_their_order(
        raw_replica: RawFactory, gateway_for: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole events one per read (relayed from the connection's callback), an event cut across reads (held by the
    relaying loop), then whole events again: the client gets every byte in order, and the tokens are accounted."""
    from gateway import upstream

    waits = []
    next_chunk = upstream._Connection.next_chunk

    async def counted(self: upstream._Connection) -> bytes:
        waits.append(1)
        return await next_chunk(self)

    monkeypatch.setattr(upstream._Connection, "next_chunk", counted)
    events = [b'data: {"n": %d}\n\n' % i for i in range(8)] + [b"data: [DONE]\n\n"]
    cut = events[3][:9], events[3][9:] + events[4]
    parts = [events[0], events[1], events[2], cut[0], cut[1], events[5], events[6] + events[7], events[8]]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = tuple(b"%x\r\n%b\r\n" % (len(p), p) for p in parts)
    replica = await raw_replica(lambda method, path, n: ((head + chunks[0], *chunks[1:], b"0\r\n\r\n"), False))
    gw = await gateway_for([replica.url])
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # the second on the pooled connection, after the first left no sink behind
            status, body = await post_completion(session, gw.url, stream=True, max_tokens=16)
            assert (status, body) == (200, b"".join(events))
    (tracked,) = gw.gateway.router.replicas.values()
    assert tracked.outstanding == 0 and tracked.inflight == 0
    # per answer the relaying task woke for the first part, the two halves of the cut event and the end: 4 of 9
    assert len(waits) <= 2 * 5, len(waits)


STALE = b'{"stale": true}'


async def test_second_answer_to_one_request_is_not_relayed(raw_replica: RawFactory,
                                                            gateway_for: GatewayFactory) -> None:
    """A replica answering one request twice: the client gets the first answer alone, and the next request its own.

    Found by fuzzing (tests/test_fuzz.py): the second answer overwrote the first's status and was appended to its
    body, and when it came later it was waiting on the pooled connection for the next request.
    """
    replica = await raw_replica(lambda method, path, n: (answer(COMPLETION) + answer(STALE, "500 Oops"), False))
    gw = await gateway_for([replica.url])
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            status, body = await post_completion(session, gw.url)
            assert (status, body) == (200, COMPLETION)
    assert len(replica.connections()) == 2  # the connection that misbehaved is not reused


async def test_pool_closes_a_connection_that_speaks_while_idle(raw_replica: RawFactory, pool: UpstreamPool) -> None:
    """An answer nobody asked for, arriving on an idle pooled connection, closes it instead of answering the next."""
    replica = await raw_replica(lambda method, path, n: ((answer(b"first"), answer(STALE)), False))
    origin = Origin.from_url(replica.url)
    assert await get_body(pool, origin) == b"first"
    await asyncio.sleep(0.1)  # the unrequested answer arrives while the connection is idle in the pool
    assert await get_body(pool, origin) == b"first"
    assert len(replica.connections("/x")) == 2


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with the openssl command."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


async def test_pool_speaks_tls_to_https_replicas(raw_replica: RawFactory, tmp_path: Path) -> None:
    """An https replica is reached over TLS, its certificate checked, and the connection reused."""
    cert, key = self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    replica = await raw_replica(lambda method, path, n: (answer(b"secure"), False), tls=server_tls)
    origin = Origin.from_url(replica.url)
    assert origin.scheme == "https"
    pool = UpstreamPool(connect_s=1.0, ssl_context=ssl.create_default_context(cafile=str(cert)))
    untrusting = UpstreamPool(connect_s=1.0)  # the system's CAs do not know this certificate
    try:
        for _ in range(2):
            assert await get_body(pool, origin) == b"secure"
        with pytest.raises(ssl.SSLCertVerificationError):
            await untrusting.request(origin, _get(origin), b"")
    finally:
        pool.close()
        untrusting.close()
    assert replica.connections("/x") == [1]
