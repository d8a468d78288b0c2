"""Fuzz harnesses: byte streams in, the gateway's promises checked, on a virtual-time event loop with no sockets.

Each harness runs one scenario on a fresh `sim.vloop.VirtualTimeLoop` (timeouts of seconds pass in microseconds)
over in-memory transports, so one run costs well under a millisecond of setup and hypothesis and atheris can
try thousands of inputs in seconds. Every harness raises `Broken` when a promise fails:

- `serve_bytes`: client bytes, split into pieces with pauses, into the HTTP server (gateway/server.py) with a
  scripted handler. No exception, no 5xx, every response well formed and complete, an OpenAI error body on every
  refusal, at most one response per request, and the connection closed within the keep-alive bound once the
  client stops sending (never a hang).
- `gateway_bytes`: client bytes into the whole gateway (server, app, parsing, router, proxy, replica client) in
  front of two in-memory replicas that answer correctly. As above, and: each client request reaches a replica at
  most once, as exactly one well-formed request carrying the client's body byte for byte.
- `relay_answers`: valid client requests through the whole gateway to replicas that answer the bytes a fuzzer
  chose (split, paused, then kept alive, closed, reset, left silent, or followed by bytes nobody asked for). Every
  client gets exactly one complete answer (the replica's, or a 502/503/504, or a stream ending in an SSE error
  event), within the timeouts; no replica gets a request after bytes reached its client, and no answer reaches
  the wrong client.
- `parse_body`: a request body into gateway/parsing.py: a `RequestInfo` with sane numbers, or a 400.

Used by tests/test_fuzz.py (hypothesis, bounded) and tests/fuzz/atheris_main.py (coverage-guided, unbounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import selectors
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httptools

from gateway import server as server_module
from gateway import upstream as upstream_module
from gateway.app import Gateway
from gateway.config import from_mapping
from gateway.errors import GatewayError
from gateway.parsing import RequestInfo, parse
from gateway.proxy import Proxy
from gateway.server import Deadlines, HttpServer, Request, Responder, Response
from gateway.tokens import TokenCounter
from gateway.upstream import Origin, UpstreamPool
from sim.vloop import VirtualTimeLoop

T = TypeVar("T")

KEEPALIVE_S = 5.0
DISCARD_S = 2.0
# A half-sent head or body is bounded by these (the defaults, 20 s, would only stretch the virtual wait).
DEADLINES = Deadlines(header_s=KEEPALIVE_S, body_s=KEEPALIVE_S)
MAX_BODY = 2048
FIRST_BYTE_S = 3.0
IDLE_S = 2.0
MODEL = "m"
_STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [ -~]*")
_HEADER_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+: [\t -~\x80-\xff]*")


class Broken(AssertionError):
    """A promise of the gateway failed for this input; the message says which."""


# -- running one scenario ------------------------------------------------------------------------------------------
class _Errors(logging.Handler):
    """Collects ERROR records: the server logs a handler's exception (and answers 500) at that level."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()} {record.exc_text or ''}")


class _SpinGuard(selectors.DefaultSelector):
    """A virtual-time selector that calls it a busy loop when the loop turns `limit` times without time passing.

    Real time would pass while code spins; virtual time does not, so a callback or task that keeps rescheduling
    itself would hang the harness instead of showing as a CPU spin.
    """

    def __init__(self, loop: VirtualTimeLoop, limit: int = 100_000) -> None:
        super().__init__()
        self._loop = loop
        self._limit = limit
        self._turns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if not events and timeout is not None and timeout > 0:
            self._loop.advance(timeout)
            self._turns = 0
        elif not events and timeout is None:
            raise Broken("the event loop has nothing scheduled and nothing ready (a deadlock)")
        else:
            self._turns += 1
            if self._turns > self._limit:
                raise Broken(f"the event loop turned {self._limit} times without time passing (a busy loop)")
        return events


class _GuardedLoop(VirtualTimeLoop):
    def __init__(self) -> None:
        self._virtual_now = 0.0
        asyncio.SelectorEventLoop.__init__(self, selector=_SpinGuard(self))
        self._clock_resolution = 1e-9


class Loop:
    """A fresh virtual-time loop that collects unhandled exceptions and logged errors; `close` raises them."""

    def __init__(self) -> None:
        self.loop = _GuardedLoop()
        self.errors: list[str] = []
        self.loop.set_exception_handler(lambda _, context: self.errors.append(
            f"{context.get('message')}: {context.get('exception')!r}"))
        self._captured = _Errors()
        logging.getLogger("gateway").addHandler(self._captured)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def problems(self) -> list[str]:
        return self.errors + self._captured.records

    def close(self) -> None:
        """Cancel what is left, close the loop; Broken if anything raised or logged an error meanwhile."""
        try:
            leftovers = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in leftovers:
                task.cancel()
            if leftovers:
                self.loop.run_until_complete(_settle(leftovers))
        finally:
            logging.getLogger("gateway").removeHandler(self._captured)
            self.loop.close()
        if self.problems():
            raise Broken("; ".join(self.problems()))


def run_scenario(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `scenario()` on a fresh virtual-time loop; Broken if anything raised or was logged as an error."""
    loop = Loop()
    try:
        result = loop.run(scenario())
    except BaseException:
        with contextlib.suppress(Broken):
            loop.close()
        raise
    loop.close()
    return result


async def _settle(tasks: list[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


# -- in-memory transports ------------------------------------------------------------------------------------------
class MemoryTransport(asyncio.Transport):
    """One side of an in-memory connection: what the protocol writes goes to `on_write`; bytes come in by `receive`.

    Like a socket transport: data received while reading is paused waits (in the 'kernel') until reading resumes;
    closing tells the protocol (and the peer) on the next loop iteration; writes after close are dropped. With
    `window`, the peer reads slowly: writing more than `window` unread bytes pauses the protocol's writing until
    the peer reads, `read_every_s` later.
    """

    def __init__(self, protocol: asyncio.Protocol, on_write: Callable[[bytes], None] | None = None,
                 window: int | None = None, read_every_s: float = 0.05) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self.protocol = protocol
        self.on_write = on_write
        self.on_close: Callable[[bool], None] | None = None  # told the peer: abort (a reset) or a clean close
        self.written = bytearray()
        self.closed = False
        self.paused = False
        self._pending: deque[bytes] = deque()
        self._window = window
        self._read_every_s = read_every_s
        self._unread = 0
        self._write_paused = False
        self._eof = False  # the peer closed cleanly behind data not read yet

    # what the protocol calls
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed:
            return
        chunk = bytes(data)
        self.written += chunk
        if self.on_write is not None:
            self.on_write(chunk)
        if self._window is not None:
            self._unread += len(chunk)
            if self._unread > self._window and not self._write_paused:
                self._write_paused = True
                self.protocol.pause_writing()
                self._loop.call_later(self._read_every_s, self._peer_reads)

    def _peer_reads(self) -> None:
        self._unread = 0
        if self._write_paused and not self.closed:
            self._write_paused = False
            self.protocol.resume_writing()

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self._shut(exc=None, reset=False)

    def abort(self) -> None:
        self._shut(exc=None, reset=True)

    def _shut(self, exc: Exception | None, reset: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self._pending.clear()
        self._loop.call_soon(self.protocol.connection_lost, exc)
        if self.on_close is not None:
            self._loop.call_soon(self.on_close, reset)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        self._loop.call_soon(self._flush)

    def is_reading(self) -> bool:
        return not self.paused

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return self._unread

    # what the peer does
    def receive(self, data: bytes) -> None:
        """Bytes from the peer (held while reading is paused, dropped once closed)."""
        if self.closed or not data:
            return
        if self.paused or self._pending:
            self._pending.append(data)
            return
        self.protocol.data_received(data)

    def _flush(self) -> None:
        while self._pending and not self.paused and not self.closed:
            self.protocol.data_received(self._pending.popleft())
        if self._eof and not self._pending and not self.paused:
            self.peer_closed()

    def peer_closed(self, reset: bool = False) -> None:
        """The peer closed the connection (cleanly: what it sent is still read first; reset: it is dropped)."""
        if self.closed:
            return
        if reset:
            self._pending.clear()
        if self._pending or (self.paused and not reset):
            self._eof = True  # a clean close is seen after the data sent before it, once reading resumes
            return
        self.closed = True
        self.protocol.connection_lost(ConnectionResetError("reset by peer") if reset else None)


# -- reading what a server wrote -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """One response as written on the wire; `complete` False when the bytes ended inside it."""

    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool


def read_answers(data: bytes, methods: Sequence[str], closed: bool) -> list[Answer]:
    """The responses in `data`, in order (`methods`: the request each answers, HEAD has no body); Broken if ill-formed.

    A response with neither length nor chunking ends with the connection: complete only when `closed`.
    """
    answers: list[Answer] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            answers.append(Answer(0, {}, b"", False))
            break
        lines = data[pos:end].split(b"\r\n")
        match = _STATUS_LINE.fullmatch(lines[0])
        if match is None:
            raise Broken(f"malformed status line {lines[0]!r}")
        status = int(match.group(1))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if _HEADER_LINE.fullmatch(line) is None:
                raise Broken(f"malformed response header line {line!r}")
            name, _, value = line.decode("latin-1").partition(": ")
            headers[name.lower()] = value
        pos = end + 4
        if 100 <= status < 200:
            continue
        method = methods[len(answers)] if len(answers) < len(methods) else "GET"
        body, pos, complete = _body(data, pos, headers, method == "HEAD", closed)
        answers.append(Answer(status, headers, body, complete))
    return answers


def _body(data: bytes, pos: int, headers: dict[str, str], head: bool, closed: bool) -> tuple[bytes, int, bool]:
    if head:
        return b"", pos, True
    if "content-length" in headers:
        n = int(headers["content-length"])
        return data[pos:pos + n], pos + n, len(data) >= pos + n
    if headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            line_end = data.find(b"\r\n", pos)
            if line_end < 0:
                return b"".join(parts), len(data), False
            size = int(data[pos:line_end], 16)
            start = line_end + 2
            if len(data) < start + size + 2:
                return b"".join(parts), len(data), False
            if data[start + size:start + size + 2] != b"\r\n":
                raise Broken(f"chunk of {size} bytes not followed by CRLF")
            pos = start + size + 2
            if size == 0:
                return b"".join(parts), pos, True
            parts.append(data[start:start + size])
    return data[pos:], len(data), closed


def check_error_body(answer: Answer) -> None:
    """An error answer the gateway made itself carries an OpenAI-style body."""
    try:
        body = json.loads(answer.body)
    except ValueError:
        raise Broken(f"{answer.status} answer without a JSON body: {answer.body[:200]!r}") from None
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict) \
            or set(body["error"]) != {"message", "type", "param", "code"}:
        raise Broken(f"{answer.status} answer without an OpenAI-style error body: {answer.body[:200]!r}")


# -- the server alone ----------------------------------------------------------------------------------------------
@dataclass
class ScriptedHandler:
    """Answers by path: `/slow*` after a pause, `/stream*` as a three-chunk stream, anything else at once."""

    calls: list[Request] = field(default_factory=list)

    async def __call__(self, request: Request, responder: Responder) -> Response | None:
        self.calls.append(request)
        if "slow" in request.path:
            await asyncio.sleep(0.3)
        if "stream" in request.path and request.method != "HEAD":
            responder.start(200, {}, "text/event-stream")
            for i in range(3):
                await responder.send(b"data: %d\n\n" % i)
                await asyncio.sleep(0.01)
            await responder.finish()
            return None
        return Response(200, json.dumps({"path": request.path, "size": len(request.body)}).encode())


class Session:
    """One client connection to a server on its own virtual-time loop, driven step by step.

    `gateway=False`: the bare HTTP server with `ScriptedHandler`; True: the whole gateway (server, app, parsing,
    router, proxy, replica client) in front of two in-memory replicas that answer correctly.
    """

    def __init__(self, gateway: bool = False, slow_reader: bool = False) -> None:
        self._loop = Loop()
        self.gateway: Gateway | None = None
        self.pool: MemoryPool | None = None
        self.client_closed = False
        self.calls: list[tuple[Request, Responder]] = []
        self._loop.run(self._start(gateway, slow_reader))

    async def _start(self, gateway: bool, slow_reader: bool) -> None:
        if gateway:
            self.gateway, self.pool = _gateway(correct_reply, Events())
            handle = self.gateway.handle
        else:
            handle = ScriptedHandler()

        async def recorder(request: Request, responder: Responder) -> Response | None:
            self.calls.append((request, responder))
            return await handle(request, responder)
        self.server = HttpServer(recorder, MAX_BODY, keepalive_s=KEEPALIVE_S, discard_s=DISCARD_S, deadlines=DEADLINES)
        self._conn = server_module._Connection(self.server)
        self.transport = MemoryTransport(self._conn, window=256 if slow_reader else None)
        self._conn.connection_made(self.transport)

    def send(self, data: bytes) -> None:
        """The client sends `data` (dropped once the connection is closed)."""
        self._loop.run(self._send(data))

    async def _send(self, data: bytes) -> None:
        self.transport.receive(data)
        await asyncio.sleep(0)

    def wait(self, seconds: float) -> None:
        self._loop.run(asyncio.sleep(seconds))

    def close_client(self) -> None:
        self.client_closed = True
        self._loop.run(self._close_client())

    async def _close_client(self) -> None:
        self.transport.peer_closed()
        await asyncio.sleep(0)

    @property
    def closed(self) -> bool:
        return self.transport.closed

    def answers(self) -> list[Answer]:
        return read_answers(bytes(self.transport.written), [r.method for r, _ in self.calls], self.closed)

    def check(self, final: bool = False) -> list[Answer]:
        """The promises that hold at any moment (`final`: and those that hold once the connection is over)."""
        if self._loop.problems():
            raise Broken("; ".join(self._loop.problems()))
        answers = self.answers()
        _check_answers(answers, len(self.calls), complete=final and not self.client_closed)
        if self.pool is not None:
            _check_forwarding(self.calls, self.pool)
        return answers

    def finish(self) -> list[Answer]:
        """Leave the connection alone: it must close within the keep-alive bound; then check everything."""
        try:
            self.wait(KEEPALIVE_S + DISCARD_S + 1.0)  # every handler here is done well within this
            if not self.closed:
                raise Broken(f"the connection is still open {KEEPALIVE_S + DISCARD_S + 1:g} s after the client's "
                             "last byte (a hang)")
            self.wait(0)
            if self.server.connections:
                raise Broken("a closed connection is still in the server's set (a leak)")
            answers = self.check(final=True)
            if self.gateway is not None and self.gateway.proxy is not None:
                self.gateway.proxy.close()
            if self.pool is not None:
                self.pool.close()
        except BaseException:
            with contextlib.suppress(Broken):
                self._loop.close()
            raise
        self._loop.close()
        return answers


def serve_bytes(pieces: Sequence[bytes], gaps: Sequence[float] = (), *, client_closes: bool = False,
                slow_reader: bool = False, gateway: bool = False) -> list[Answer]:
    """Feed `pieces` (the i-th after `gaps[i]` virtual seconds) to one connection; check the promises; the answers."""
    session = Session(gateway, slow_reader)
    for i, piece in enumerate(pieces):
        if i < len(gaps) and gaps[i]:
            session.wait(gaps[i])
        if session.closed:
            break
        session.send(piece)
        session.check()
    if client_closes:
        session.close_client()
    return session.finish()


def _check_answers(answers: list[Answer], calls: int, complete: bool) -> None:
    for i, answer in enumerate(answers):
        if answer.status >= 500:
            raise Broken(f"answer {i} is a {answer.status} for the client's bytes: {answer.body[:200]!r}")
        if not answer.complete and complete:
            raise Broken(f"answer {i} ({answer.status}) was cut short")
        if answer.status >= 400 and answer.complete and answer.body:
            check_error_body(answer)
    refusals = len(answers) - calls
    if refusals > 1 or (refusals < 0 and complete):
        raise Broken(f"{len(answers)} answers to {calls} handled requests")
    if refusals == 1:
        last = answers[-1]
        if not 400 <= last.status < 500 or last.headers.get("connection") != "close":
            raise Broken(f"an answer the handler did not give: {last}")


# -- the whole gateway, in front of in-memory replicas -------------------------------------------------------------
@dataclass(frozen=True)
class Received:
    """One request as a replica parsed it."""

    seq: int  # when, on the scenario's event counter
    replica: str
    conn: int  # which connection carried it
    request_id: str
    method: str
    target: str
    body: bytes


class Events:
    """One counter for every event a scenario orders (a replica's receipt, a client's first byte)."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def next(self) -> int:
        return next(self._count)


Script = Callable[[Received], "Reply"]


@dataclass(frozen=True)
class Reply:
    """How a replica answers one request: `pieces` after `gaps`, then `ending`.

    ending: "keep" (the connection stays open for the next request), "close", "reset", "silent" (open, never another
    byte), or "extra" (then a whole answer nobody asked for, marked with the request id, and the connection kept).
    """

    pieces: tuple[bytes, ...]
    gaps: tuple[float, ...] = ()
    ending: str = "keep"


def stale_marker(request_id: str) -> bytes:
    return b'"stale-for": "%s"' % request_id.encode()


class MemoryReplica(asyncio.Protocol):
    """A replica's side of one in-memory connection: parses requests, answers each as `script` says."""

    _conns = itertools.count(1)

    def __init__(self, name: str, script: Script, received: list[Received], events: Events,
                 malformed: list[str]) -> None:
        self._name = name
        self._conn = next(MemoryReplica._conns)
        self._script = script
        self._received = received
        self._events = events
        self._malformed = malformed
        self._parser = httptools.HttpRequestParser(self)
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._url = b""
        self.transport: MemoryTransport | None = None
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, MemoryTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._malformed.append(f"{self._name} could not parse what the gateway sent: {exc}")
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self._tasks:
            task.cancel()

    def on_message_begin(self) -> None:
        self._headers, self._body, self._url = {}, [], b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        received = Received(self._events.next(), self._name, self._conn, self._headers.get("x-request-id", ""),
                            self._parser.get_method().decode("latin-1"), self._url.decode("latin-1"),
                            b"".join(self._body))
        self._received.append(received)
        task = self._loop.create_task(self._answer(self._script(received), received.request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, reply: Reply, request_id: str) -> None:
        transport = self.transport
        assert transport is not None
        for i, piece in enumerate(reply.pieces):
            await asyncio.sleep(reply.gaps[i] if i < len(reply.gaps) else 0.0)
            transport.write(piece)
        if reply.ending == "close":
            transport.close()
        elif reply.ending == "reset":
            transport.abort()
        elif reply.ending == "extra":
            # Marked stale only when what came before was a whole answer: else these bytes may still belong to it.
            marker = stale_marker(request_id) if _whole_answer(b"".join(reply.pieces)) else b'"tail": 1'
            body = b'{%b}' % marker
            transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                            % (len(body), body))


class _Whole:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done = False

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() >= 200:
            self.done = True


def _whole_answer(data: bytes) -> bool:
    """Whether `data` holds a whole (final) HTTP answer."""
    whole = _Whole()
    try:
        whole.parser.feed_data(data)
    except httptools.HttpParserError:
        return whole.done
    return whole.done


class MemoryPool(UpstreamPool):
    """The gateway's replica client, connecting to in-memory replicas instead of sockets."""

    def __init__(self, connect_s: float, script: Script, events: Events) -> None:
        super().__init__(connect_s)
        self.script = script
        self.events = events
        self.received: list[Received] = []
        self.malformed: list[str] = []

    async def _connect(self, origin: Origin) -> upstream_module._Connection:
        conn = upstream_module._Connection(self, origin)
        replica = MemoryReplica(f"{origin.host}:{origin.port}", self.script, self.received, self.events,
                                self.malformed)
        to_replica = MemoryTransport(conn)
        to_gateway = MemoryTransport(replica)
        to_replica.on_write = to_gateway.receive
        to_gateway.on_write = to_replica.receive
        to_replica.on_close = to_gateway.peer_closed
        to_gateway.on_close = to_replica.peer_closed
        conn.connection_made(to_replica)
        replica.connection_made(to_gateway)
        return conn


def correct_reply(received: Received) -> Reply:
    """What a healthy replica answers: a stream when the body asks for one, else JSON (404 off the known paths)."""
    try:
        body = json.loads(received.body) if received.body else {}
    except ValueError:
        body = {}
    if received.target.split("?")[0] not in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        return Reply((_json_answer(b'{"error": {"message": "not found", "type": "NotFoundError", "param": null, '
                                   b'"code": 404}}', "404 Not Found", head=received.method == "HEAD"),))
    if isinstance(body, dict) and body.get("stream") is True:
        events = [b'data: {"choices": [{"index": 0, "text": " tok"}]}\n\n'] * 3 + [b"data: [DONE]\n\n"]
        chunks = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
        return Reply((b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
                      chunks), (0.0, 0.01))
    return Reply((_json_answer(b'{"choices": [{"index": 0, "text": " tok"}]}'),))


def _json_answer(body: bytes, status: str = "200 OK", head: bool = False) -> bytes:
    return (b"HTTP/1.1 %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
            % (status.encode(), len(body), b"" if head else body))


def _gateway(script: Script, events: Events, api_keys: Sequence[str] = ()) -> tuple[Gateway, MemoryPool]:
    config = from_mapping({
        "replicas": ["http://r1.test:8001", "http://r2.test:8002"], "host": "127.0.0.1", "port": 0,
        "max_body_bytes": MAX_BODY, "api_keys": list(api_keys),
        "timeouts": {"connect_s": 1, "first_byte_s": FIRST_BYTE_S, "idle_s": IDLE_S},
        "retry": {"max_attempts": 3, "max_time_s": 10}})
    gateway = Gateway(config)
    for replica in gateway.router.replicas.values():
        replica.healthy = True
        replica.models = frozenset({MODEL})
    pool = MemoryPool(config.timeouts.connect_s, script, events)
    gateway.proxy = Proxy(config, gateway.router, pool, gateway.metrics)
    return gateway, pool


def gateway_bytes(pieces: Sequence[bytes], gaps: Sequence[float] = (), *, client_closes: bool = False,
                  slow_reader: bool = False) -> list[Answer]:
    """Client bytes into the whole gateway in front of two correct in-memory replicas; check the promises."""
    return serve_bytes(pieces, gaps, client_closes=client_closes, slow_reader=slow_reader, gateway=True)


def _check_forwarding(calls: list[tuple[Request, Responder]], pool: MemoryPool) -> None:
    """Each client request reached a replica at most once, well formed, with its body byte for byte."""
    if pool.malformed:
        raise Broken("; ".join(pool.malformed))
    ids = Counter(responder.headers.get("x-request-id", "") for _, responder in calls)
    upstream = Counter(r.request_id for r in pool.received)
    extra = upstream - ids
    if extra:
        raise Broken(f"requests reached the replicas more often than clients sent them: {dict(extra)}")
    bodies = {responder.headers.get("x-request-id", ""): request for request, responder in calls}
    for received in pool.received:
        request = bodies[received.request_id]
        if ids[received.request_id] == 1 and (received.body, received.target) != (request.body, request.target):
            raise Broken(f"request {received.request_id} reached the replica changed: {received.target!r} "
                         f"{received.body[:100]!r} instead of {request.target!r} {request.body[:100]!r}")


# -- fuzzed replica answers ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientRequest:
    """A valid client request for `relay_answers`."""

    path: str = "/v1/completions"
    stream: bool = False

    def encode(self, request_id: str) -> bytes:
        if self.path == "/v1/chat/completions":
            payload: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        else:
            payload = {"model": MODEL, "prompt": "hello"}
        payload.update(max_tokens=4, stream=self.stream)
        body = json.dumps(payload).encode()
        return (b"POST %b HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"X-Request-Id: %b\r\n\r\n%b" % (self.path.encode(), len(body), request_id.encode(), body))


@dataclass(frozen=True)
class RelayRun:
    answers: list[Answer]  # one per client request, in order
    received: list[Received]


def relay_answers(requests: Sequence[ClientRequest], replies: Iterator[Reply], *, concurrent: bool = False) -> RelayRun:
    """Send `requests` (one connection each, one after another or all at once) through the gateway to replicas
    that answer with `replies`, in the order requests reach them; check every client gets one clean answer."""
    async def scenario() -> RelayRun:
        events = Events()
        script_replies = replies

        def script(received: Received) -> Reply:
            return next(script_replies, Reply((), ending="close"))
        gateway, pool = _gateway(script, events)
        server = HttpServer(gateway.handle, MAX_BODY, keepalive_s=KEEPALIVE_S, discard_s=DISCARD_S, deadlines=DEADLINES)
        first_bytes: dict[str, int] = {}
        transports: list[MemoryTransport] = []

        async def one(i: int, request: ClientRequest) -> None:
            request_id = f"req-{i}"
            conn = server_module._Connection(server)
            transport = MemoryTransport(conn, on_write=lambda _: first_bytes.setdefault(request_id, events.next()))
            transports.append(transport)
            conn.connection_made(transport)
            transport.receive(request.encode(request_id))
            limit = 10 + FIRST_BYTE_S + 64 * IDLE_S  # the retry budget, a first byte, then a slow stream
            deadline = asyncio.get_running_loop().time() + limit
            while not _answered(transport, request.path) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if not _answered(transport, request.path):
                raise Broken(f"request {request_id} got no complete answer within {limit:g} s (a hang): "
                             f"{bytes(transport.written)[:300]!r}")
        if concurrent:
            await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        else:
            for i, request in enumerate(requests):
                await one(i, request)
        answers = [read_answers(bytes(t.written), ["POST"], closed=t.closed)[0] for t in transports]
        for transport in transports:
            transport.peer_closed()
        await asyncio.sleep(0)
        _check_relayed(answers, requests, pool, first_bytes)
        gateway.proxy.close()  # type: ignore[union-attr]
        pool.close()
        return RelayRun(answers, pool.received)
    return run_scenario(scenario)


def _answered(transport: MemoryTransport, path: str) -> bool:
    data = bytes(transport.written)
    if not data:
        return False
    try:
        answers = read_answers(data, ["POST"], closed=transport.closed)
    except (Broken, ValueError):
        return True  # ill-formed: let the checks say so
    return bool(answers) and answers[0].complete


def _check_relayed(answers: list[Answer], requests: Sequence[ClientRequest], pool: MemoryPool,
                   first_bytes: dict[str, int]) -> None:
    if pool.malformed:
        raise Broken("; ".join(pool.malformed))
    # Retries (max_attempts 3) go to other replicas; within one attempt the pool resends once, on a new connection,
    # a request whose reused connection closed before any byte of the answer (the replica closing it while idle).
    for i, (answer, request) in enumerate(zip(answers, requests)):
        request_id = f"req-{i}"
        mine = [r for r in pool.received if r.request_id == request_id]
        replicas = len({r.replica for r in mine})
        if len(mine) > 2 * replicas or replicas > 3 or len({r.conn for r in mine}) < len(mine):
            raise Broken(f"{request_id} reached replicas too often: {[(r.replica, r.conn) for r in mine]}")
        late = [r for r in pool.received if r.request_id == request_id and r.seq > first_bytes.get(request_id, 1 << 62)]
        if late:
            raise Broken(f"{request_id} reached {late[0].replica} after bytes had reached its client")
        if b'"stale-for"' in answer.body:
            raise Broken(f"{request_id}'s client got bytes a replica sent after a whole answer: {answer.body[:300]!r}")
        if answer.status == 500 and b"internal_error" in answer.body:
            raise Broken(f"{request_id}: the gateway failed with a 500: {answer.body[:200]!r}")
        if answer.status in (502, 503, 504) and answer.headers.get("x-gateway-replica") is None:
            check_error_body(answer)
        if answer.headers.get("transfer-encoding") == "chunked" and not answer.complete:
            raise Broken(f"{request_id}: a stream that did not end cleanly")
        if b"upstream_stream_error" in answer.body:
            check_error_event(answer.body)


def check_error_event(body: bytes) -> None:
    """The gateway's final SSE error event is an event of its own that an SSE client can read."""
    last = body.rstrip(b"\r\n").replace(b"\r\n", b"\n").rsplit(b"\n\n", 1)[-1]
    if not last.startswith(b"data: "):
        raise Broken(f"the SSE error event is glued to what came before it: {body[-300:]!r}")
    try:
        json.loads(last[len(b"data: "):])
    except ValueError:
        raise Broken(f"the SSE error event is not JSON: {last[:300]!r}") from None


# -- request parsing -----------------------------------------------------------------------------------------------
_ENDPOINTS = ("completions", "chat", "embeddings")


def parse_body(raw: bytes, endpoint: str) -> RequestInfo | GatewayError:
    """`parse` on `raw`: a RequestInfo with sane numbers, or a 400 naming the problem; Broken otherwise."""
    if endpoint not in _ENDPOINTS:
        raise ValueError(f"endpoint must be one of {_ENDPOINTS}")
    try:
        info = parse(raw, endpoint, TokenCounter(), 16)
    except GatewayError as exc:
        if exc.status != 400 or not exc.message:
            raise Broken(f"parse answered {exc.status}: {exc.message}") from None
        return exc
    if not isinstance(info.model, str) or not info.model:
        raise Broken(f"parsed a request without a model: {info}")
    if not isinstance(info.prompt_tokens, int) or info.prompt_tokens < 0 or not isinstance(info.max_tokens, int) \
            or info.max_tokens < 0 or not isinstance(info.stream, bool):
        raise Broken(f"parsed nonsense: {info}")
    return info
