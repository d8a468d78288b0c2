"""The gateway's client to the replicas: pooled keep-alive HTTP/1.1 connections, parsed with httptools.

One pool per gateway, one idle list per replica (most recently used first: its caches are warm). A connection
goes back to the pool only when its response was read to the end and the replica kept it alive; one idle longer
than `idle_s` is closed instead of reused, so it is never one the replica is closing (vLLM's server, uvicorn,
closes idle connections after 5 s). A timer closes them once `idle_s` has passed even when no request comes to
take one, so a replica with a long keep-alive does not hold the gateway's descriptors after a burst. A reused
connection that fails before any byte of the answer is retried once on a new one: the replica closed it while idle
and never saw the request. Read timeouts are the caller's (the proxy's watchdog); connecting is bounded here by
`connect_s`.
"""

from __future__ import annotations

import asyncio
import math
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

# A body part as it arrived and how many chunks it held
Sink = Callable[[bytes, int], bool]
# Events relayed from the replica connection's callback are counted down on their lease this many at a time (one
# event a chunk: the connection counts the chunks). A stream's load reads at most that many tokens high meanwhile;
# its end returns the rest at once. Counting and timing each event cost 5% of the gateway's CPU per paced event.
TALLY_EVERY = 8
_PAUSE_AT = 256 * 1024  # stop reading from a replica while this much of its answer waits for the client
_REAP_EARLY_S = 0.001  # a timer may fire a hair early: a connection this close to idle_s is closed, not waited for


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica listens, parsed once from its URL."""

    scheme: str
    host: str
    port: int
    host_header: bytes  # what a request to it sends as `Host`
    _hash: int = field(init=False, repr=False, compare=False)  # the pool's key, hashed twice per request

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.scheme, self.host, self.port, self.host_header)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_url(cls, url: str) -> Origin:
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        host = parts.hostname or ""
        default = 443 if scheme == "https" else 80
        port = parts.port or default
        shown = f"[{host}]" if ":" in host else host
        return cls(scheme, host, port, (shown if port == default else f"{shown}:{port}").encode("idna"))


class Direct(Protocol):
    """A client connection a replica's chunks can be written to as they came (http_connection.Connection)."""

    open_transport: asyncio.Transport | None


def _ignore(count: int) -> None:
    pass


class _Connection(asyncio.Protocol):
    """One connection to a replica, carrying one request at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[None] | None = None
        self.headers: dict[str, str] = {}
        self.status = 0
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False  # reading, while the caller catches up
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the current answer
        self.error: Exception | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        # Takes body parts as they arrive, in the protocol's callback, while nothing is queued (UpstreamResponse.splice)
        self.sink: Sink | None = None
        self.direct: Direct | None = None  # a client connection to write a read of one whole chunk to (relay_to)
        self.tally: Callable[[int], None] = _ignore  # told of the reads written there, TALLY_EVERY at a time
        self.relayed = 0  # reads written to `direct` since the sink was set
        self._gathered: list[bytes] | None = None  # body parts of one read, offered to the sink as one
        self._framed = False  # the answer has a length or chunked encoding (else it ends with the connection)
        self._chunked = False  # the answer has chunked encoding
        self._aligned = False  # the last read ended at the end of a chunk (known only while a sink is set)
        self._head_only = False  # the request is HEAD: its answer ends with its head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.head = self._loop.create_future()
        self.headers, self.status, self.complete, self.keep_alive, self.received = {}, 0, False, False, False
        self.buffered = 0
        self._aligned = False
        self._head_only = data.startswith(b"HEAD ")
        self._resume()
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        direct = self.direct
        if direct is not None and self._aligned and not self.chunks and data.endswith(b"\n\n\r\n"):
            # A streamed token's usual read: one whole chunk, one whole event, after a read that ended a chunk (so
            # nothing is held back or queued before it). Its size is read here, and the parser, which would end
            # where it began (before a chunk's size), is skipped with its callback per token.
            cut = data.find(b"\r\n")
            if 0 < cut < 9 and b"%x" % (len(data) - cut - 4) == data[:cut]:  # lower-case hex, as h11 and aiohttp
                transport = direct.open_transport
                if transport is not None:
                    transport.write(data)
                    relayed = self.relayed = self.relayed + 1
                    if not relayed % TALLY_EVERY:
                        self.tally(TALLY_EVERY)
                else:
                    self._queue(data[cut + 2:-2])  # the client is behind, or gone: for readany
                return
        self.received = True  # (a sink is only set once the head has come)
        sink = self.sink
        # A read often holds several chunks (tokens that came out together): with a sink they reach it as one
        # part, one write to the client instead of one per chunk.
        gathered: list[bytes] | None = [] if sink is not None else None
        self._gathered = gathered
        error = None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            error = exc
        self._gathered = None
        # Whether this read ended a chunk: its last body bytes end an event and the chunk's CRLF follows at once.
        self._aligned = (gathered is not None and len(gathered) > 0 and self._chunked and not self.complete
                         and gathered[-1].endswith(b"\n\n") and data.endswith(b"\n\n\r\n"))
        if sink is not None and gathered:
            body = gathered[0] if len(gathered) == 1 else b"".join(gathered)
            if self.chunks or not sink(body, len(gathered)):  # behind queued parts, or declined: for readany
                self._queue(body)
        if error is not None:
            self._fail(ConnectionError(f"malformed HTTP from the replica: {error}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.forget(self)
        if exc is None and self.head is not None and self.head.done() and not self._framed and not self.complete:
            self.complete = True  # an answer without length or chunking ends with the connection (not a reset)
            self._wake()
        self._fail(exc or ConnectionResetError("the replica closed the connection"))
        self.transport = None

    # -- httptools callbacks ----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: it would overwrite the first and desync the next one
            raise ConnectionError("the replica sent more than one answer to one request")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if not 100 <= self.status <= 599:  # llhttp takes any three digits; relayed, "020" made a broken status line
            raise ConnectionError(f"the replica answered with status {self.status:03d}")
        if 100 <= self.status < 200:
            self.headers = {}  # an interim answer (100 Continue): the real head follows
            return
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "")
        self._framed = self._chunked or "content-length" in self.headers
        if self._head_only:  # httptools cannot be told to skip the body a HEAD answer names: end it here
            self.complete, self.keep_alive = True, self._parser.should_keep_alive()
            self._parser = httptools.HttpResponseParser(self)  # the next answer starts afresh
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._gathered is not None:  # a sink is set: offered it once the read is parsed (data_received)
            self._gathered.append(body)
        else:
            self._queue(body)

    def _queue(self, body: bytes) -> None:
        """For `readany`: no sink, or the sink left it."""
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200:
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()  # only true inside this callback
        self._wake()

    # -- reading ----------------------------------------------------------------------------------------------
    async def next_chunk(self) -> bytes:
        """What has arrived of the body since the last call (waiting for some); b"" at its end."""
        while not self.chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            await self._waiter
        if len(self.chunks) == 1:
            data = self.chunks.popleft()
        else:
            data = b"".join(self.chunks)
            self.chunks.clear()
        self.buffered = 0
        self._resume()
        return data

    def _resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None and not self.complete:
            self.error = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(self.error or exc)
            self.head.exception()  # retrieved here; the caller sees it through `await head`
        self._wake()

    @property
    def reusable(self) -> bool:
        return (self.complete and self.error is None and self.transport is not None
                and not self.transport.is_closing() and self.keep_alive)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A replica's answer: status and headers at once, the body read whole or chunk by chunk."""

    __slots__ = ("_conn", "_pool", "status", "headers", "_closed")

    def __init__(self, conn: _Connection, pool: UpstreamPool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = conn.status
        self.headers = conn.headers
        self._closed = False

    @property
    def content_type(self) -> str:
        """The media type, without parameters, lower-case."""
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    @property
    def ended(self) -> bool:
        """The whole body has arrived and been read."""
        return self._conn.complete and not self._conn.chunks

    async def readany(self) -> bytes:
        """The next part of the body that has arrived; b"" at its end."""
        return await self._conn.next_chunk()

    @property
    def relayed(self) -> int:
        """Reads of one whole chunk written straight to the client (`relay_to`; tallied TALLY_EVERY at a time)."""
        return self._conn.relayed

    def relay_to(self, target: Direct) -> None:
        """While a sink is set, write each read of one whole chunk ending in a whole event that follows a read
        that ended a chunk to `target.open_transport` as it came (size line and CRLF included), with no call: the
        target takes chunked encoding and its head has gone. Where it is None the read is queued for `readany`."""
        if self._conn.sink is not None:
            self._conn.direct = target

    def splice(self, sink: Sink | None, tally: Callable[[int], None] | None = None) -> None:
        """From now on offer each part of the body to `sink` as it arrives, before any `readany` (None: stop).

        A part is what one read brought, its chunks joined; the sink is told how many chunks (a replica streaming
        server-sent events writes one event a chunk, so this counts them without searching the bytes).

        Reads written straight to a client (`relay_to`) are counted in `relayed`, and told to `tally` every
        TALLY_EVERY.

        A part the sink takes (it returns True) is never seen by `readany`; one it declines is queued, and later parts
        are queued behind it until `readany` has taken them all, so the order holds. A streamed answer's parts then
        reach the client from the protocol's callback, without waking the relaying task once per token.
        """
        conn = self._conn
        conn.sink, conn.direct, conn.tally = sink, None, tally or _ignore
        if sink is not None:
            conn.relayed = 0

    async def read(self) -> bytes:
        """The whole body."""
        conn = self._conn
        if conn.complete and len(conn.chunks) <= 1:  # usually: a small answer arrives with its head
            return conn.chunks.popleft() if conn.chunks else b""
        parts = []
        while chunk := await conn.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Give the connection back when the answer was read to its end; otherwise close it (aborting the request)."""
        if self._closed:
            return
        self._closed = True
        if self._conn.reusable and not self._conn.chunks:
            self._pool.put(self._conn)
        else:
            self._conn.close()


class UpstreamPool:
    """Keep-alive connections to the replicas."""

    def __init__(self, connect_s: float, idle_s: float = 4.0, ssl_context: ssl.SSLContext | None = None) -> None:
        self._connect_s = connect_s
        self._idle_s = idle_s
        self._ssl = ssl_context
        self._loop = asyncio.get_running_loop()  # once: each lookup is a getpid() system call on Python 3.11
        self._idle: dict[Origin, list[_Connection]] = {}  # each list oldest first: idle since it was put back
        self._closed = False
        self._reaper: asyncio.TimerHandle | None = None  # closes idle connections once idle_s has passed

    async def request(self, origin: Origin, head: bytes, body: bytes) -> UpstreamResponse:
        """Send one request (`head` is its request line and headers, ending in a blank line); wait for its head."""
        conn = self._take(origin)
        if conn is not None:
            conn.send(head + body)
            try:
                await self._wait_head(conn)
                return UpstreamResponse(conn, self)
            except OSError:
                if conn.received:
                    raise
                conn.close()  # closed by the replica while idle: it never saw the request
        conn = await self._connect(origin)
        conn.send(head + body)
        try:
            await self._wait_head(conn)
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(conn, self)

    @staticmethod
    async def _wait_head(conn: _Connection) -> None:
        assert conn.head is not None
        try:
            await conn.head
        except asyncio.CancelledError:
            conn.close()
            raise

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = self._loop.time()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self._idle_s and conn.transport is not None and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = self._loop
        context = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        async with asyncio.timeout(self._connect_s):
            _, conn = await loop.create_connection(lambda: _Connection(self, origin), origin.host, origin.port,
                                                   ssl=context, server_hostname=origin.host if context else None)
        return conn

    def put(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = self._loop.time()
        conn.head = None
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._reaper is None:
            self._reaper = self._loop.call_at(conn.idle_since + self._idle_s, self._reap)

    def _reap(self) -> None:
        """Close the connections idle for `idle_s`; come back when the next one will have been."""
        self._reaper = None
        now = self._loop.time()
        next_due = math.inf
        for idle in self._idle.values():
            stale = 0
            while stale < len(idle) and idle[stale].idle_since + self._idle_s <= now + _REAP_EARLY_S:
                stale += 1
            expired, idle[:stale] = idle[:stale], []
            for conn in expired:
                conn.close()
            if idle:
                next_due = min(next_due, idle[0].idle_since + self._idle_s)
        if next_due < math.inf:
            self._reaper = self._loop.call_at(next_due, self._reap)

    def forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Close every idle connection; connections in use close when their requests end."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
