"""The soak's clients: each sends one request and records exactly one outcome for it.

Kinds: `json` and `stream` (ordinary clients, through aiohttp), `abort` (a streaming client that hangs up after a
few events), `slow` (a streaming client on a raw socket with a small receive buffer that reads a little at a time)
and `malformed:*` (bad HTTP or bad JSON on a raw socket). Results:

- complete: a 200 with choices, or a stream that ended with `data: [DONE]` and no error event;
- error: an OpenAI-style error (status >= 400 with `{"error": {...}}`, or a final SSE error event and a clean end);
- aborted: the client hung up on purpose;
- broken: anything else (a cut stream, a reset, a body that is not what it should be);
- hung: no byte for `stall_s` (the gateway's timeouts bound every silence well below it), or no outcome
  within `cap_s` at all. A slow answer that keeps coming (a replica slowed ten times) is not hung.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httptools

PROMPT_WORDS = ("the", "replica", "gateway", "token", "stream", "batch", "cache", "model", "queue", "answer")
SLOW_TOKENS = 64
SLOW_READ = (256, 0.1)  # bytes per read, seconds between reads: slower than the tokens come (~1.5 KB/s)
MALFORMED = ("bad-json", "unknown-model", "bad-type", "garbage", "huge-header", "too-large", "wrong-method")


@dataclass
class Outcome:
    """What happened to one request."""

    request_id: str
    kind: str
    sent_at: float  # time.monotonic()
    result: str = "lost"
    status: int = 0
    first_byte_at: float | None = None  # when the answer's head reached the client
    ended_at: float = 0.0
    replica: str = ""
    detail: str = ""

    def finish(self, result: str, detail: str = "") -> None:
        if self.result != "lost":
            raise RuntimeError(f"{self.request_id} got a second outcome ({result} after {self.result})")
        self.result, self.detail, self.ended_at = result, detail[:300], time.monotonic()


def is_openai_error(body: Any) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and {"message", "type", "param", "code"} <= set(body["error"]))


@dataclass(frozen=True)
class RequestShape:
    """A generation request's size (prompt words, output tokens) and endpoint."""

    chat: bool
    prompt: str
    max_tokens: int

    @classmethod
    def draw(cls, rng: random.Random) -> RequestShape:
        words = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(8, 40)))
        return cls(rng.random() < 0.4, words, rng.randint(16, 64))

    def body(self, model: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class SseCheck:
    """Reads SSE events as they come: whether the stream ended with [DONE], or with an error event."""

    buffer: bytes = b""
    events: int = 0
    done: bool = False
    error: bool = False
    bad: str = ""
    after_end: int = 0  # events after [DONE] or an error event (there must be none)

    def feed(self, data: bytes) -> None:
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data:
            return
        if self.done or self.error:
            self.after_end += 1
        self.events += 1
        if data == b"[DONE]":
            self.done = True
            return
        try:
            parsed = json.loads(data)
        except ValueError:
            self.bad = self.bad or f"an SSE event that is not JSON: {data[:120]!r}"
            return
        if isinstance(parsed, dict) and "error" in parsed:
            self.error = True

    def result(self) -> tuple[str, str]:
        if self.bad:
            return "broken", self.bad
        if self.buffer.strip():
            return "broken", f"the stream ended inside an event: {self.buffer[:120]!r}"
        if self.after_end:
            return "broken", f"{self.after_end} event(s) after the end"
        if self.error:
            return "error", "SSE error event"
        if self.done:
            return "complete", ""
        return "broken", f"the stream ended without [DONE] or an error event after {self.events} events"


@dataclass
class Clients:
    """Sends requests of every kind to the gateway at `host`:`port`, recording one `Outcome` each."""

    host: str
    port: int
    model: str
    stall_s: float
    cap_s: float
    rng: random.Random
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None
    _count: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def new(self, kind: str) -> Outcome:
        self._count += 1
        outcome = Outcome(f"soak-{self._count}", kind, time.monotonic())
        self.outcomes[outcome.request_id] = outcome
        return outcome

    async def send(self, kind: str) -> None:
        """One request of `kind`; its outcome is recorded whatever happens (a hang as `hung`)."""
        outcome = self.new(kind)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.cap_s), asyncio.timeout(self.stall_s) as stall:
                def progress() -> None:
                    stall.reschedule(loop.time() + self.stall_s)
                if kind in ("json", "stream", "abort"):
                    await self._ordinary(outcome, progress, stream=kind != "json",
                                         hang_up_after=self.rng.randint(1, 4) if kind == "abort" else None)
                elif kind == "slow":
                    await self._slow_reader(outcome, progress)
                else:
                    await self._malformed(outcome, kind.partition(":")[2])
        except TimeoutError:
            if outcome.result == "lost":
                outcome.finish("hung", f"no byte for {self.stall_s:g} s, or no outcome within {self.cap_s:g} s")
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError, httptools.HttpParserError) as exc:
            if outcome.result == "lost":
                outcome.finish("broken", repr(exc))

    # -- ordinary clients -----------------------------------------------------------------------------------------
    async def _ordinary(self, outcome: Outcome, progress: Callable[[], None], stream: bool,
                        hang_up_after: int | None) -> None:
        assert self.session is not None
        shape = RequestShape.draw(self.rng)
        async with self.session.post(self.url + shape.path, json=shape.body(self.model, stream),
                                     headers={"X-Request-Id": outcome.request_id}) as resp:
            outcome.first_byte_at = time.monotonic()
            progress()
            outcome.status = resp.status
            outcome.replica = resp.headers.get("x-gateway-replica", "")
            if resp.status != 200 or not stream:
                await self._whole(outcome, await resp.read())
                return
            check = SseCheck()
            async for data in resp.content.iter_any():
                progress()
                check.feed(data)
                if hang_up_after is not None and check.events >= hang_up_after and not (check.done or check.error):
                    resp.close()  # drops the connection: the gateway must abort the upstream request
                    outcome.finish("aborted", f"after {check.events} events")
                    return
            outcome.finish(*check.result())

    @staticmethod
    async def _whole(outcome: Outcome, raw: bytes) -> None:
        try:
            body = json.loads(raw)
        except ValueError:
            outcome.finish("broken", f"{outcome.status} with a body that is not JSON: {raw[:120]!r}")
            return
        if outcome.status == 200 and isinstance(body, dict) and body.get("choices"):
            outcome.finish("complete")
        elif outcome.status >= 400 and is_openai_error(body):
            outcome.finish("error", f"{outcome.status} {body['error'].get('code')}")
        else:
            outcome.finish("broken", f"{outcome.status} {raw[:160]!r}")

    # -- raw-socket clients ---------------------------------------------------------------------------------------
    async def _open(self, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        except OSError:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock, limit=2 ** 20)

    async def _slow_reader(self, outcome: Outcome, progress: Callable[[], None]) -> None:
        """A streamed request read a little at a time, more slowly than it is generated, through a small buffer."""
        shape = RequestShape.draw(self.rng)
        body = json.dumps({**shape.body(self.model, True), "max_tokens": SLOW_TOKENS}).encode()
        reader, writer = await self._open(rcvbuf=2048)
        try:
            writer.write(b"POST %b HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"X-Request-Id: %b\r\nConnection: close\r\n\r\n%b"
                         % (shape.path.encode(), len(body), outcome.request_id.encode(), body))
            await writer.drain()
            response = _RawResponse()
            while not response.complete:
                data = await reader.read(SLOW_READ[0])
                if not data:
                    break
                progress()
                if outcome.first_byte_at is None:
                    outcome.first_byte_at = time.monotonic()
                response.feed(data)
                await asyncio.sleep(SLOW_READ[1])
        finally:
            writer.close()
        outcome.status, outcome.replica = response.status, response.headers.get("x-gateway-replica", "")
        if not response.complete:
            outcome.finish("broken", f"the answer ended early ({response.status}, {len(response.body)} bytes)")
        elif response.status == 200:
            check = SseCheck()
            check.feed(bytes(response.body))
            outcome.finish(*check.result())
        else:
            await self._whole(outcome, bytes(response.body))

    async def _malformed(self, outcome: Outcome, what: str) -> None:
        """A request the gateway must refuse with a 4xx and an OpenAI-style body (and never pass on)."""
        rid = outcome.request_id.encode()
        good = json.dumps(RequestShape.draw(self.rng).body(self.model, False)).encode()
        bodies = {"bad-json": b'{"model": "%b", "prompt": ' % self.model.encode(),
                  "unknown-model": good.replace(self.model.encode(), b"no-such-model"),
                  "bad-type": good.replace(b'"max_tokens": ', b'"max_tokens": "many", "x": '),
                  "too-large": b" " * 100_000 + good}
        if what == "garbage":
            raw = b"HELLO THERE\r\n\r\n"
        elif what == "huge-header":
            raw = b"POST /v1/completions HTTP/1.1\r\nX-Request-Id: %b\r\nX-Big: %b\r\n\r\n" % (rid, b"x" * 70_000)
        elif what == "wrong-method":
            raw = b"GET /v1/completions HTTP/1.1\r\nHost: soak\r\nX-Request-Id: %b\r\n\r\n" % rid
        else:
            body = bodies[what]
            raw = (b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\nX-Request-Id: %b\r\n\r\n%b" % (len(body), rid, body))
        reader, writer = await self._open()
        try:
            writer.write(raw)
            await writer.drain()
            response = _RawResponse()
            while not response.complete:
                data = await reader.read(65536)
                if not data:
                    break
                if outcome.first_byte_at is None:
                    outcome.first_byte_at = time.monotonic()
                response.feed(data)
        finally:
            writer.close()
        outcome.status = response.status
        if not response.complete or not 400 <= response.status < 500:
            outcome.finish("broken", f"{what}: {response.status} complete={response.complete}")
        else:
            await self._whole(outcome, bytes(response.body))


class _RawResponse:
    """An HTTP response read off a raw socket with httptools."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.complete = False

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True
