"""What the gateway promises under hostile clients (SECURITY.md names these tests next to each promise).

Raw sockets play the clients no library would be: slow loris heads and bodies, readers that stop reading, floods
of connections and of unknown models. Requests go to in-process FAKE replicas (tests/fake_replica.py); the
file-descriptor tests run the real `gateway serve` in a subprocess under a low RLIMIT_NOFILE.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import json
import os
import random
import re
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from gateway import server as server_module
from gateway import tokens as tokens_module
from gateway.config import ConfigError
from gateway.limits import RESERVED, default_max_connections, raise_fd_limit
from gateway.parsing import parse
from gateway.server import Deadlines, HttpServer, Request, Responder, Response
from gateway.tokens import EXACT_MAX_BYTES, MAX_DISCOVERED, TokenCounter, estimate
from tests.conftest import FakeFactory, GatewayFactory, until
from tests.test_gateway_http import Echo, Sleeper, connect, read_eof, read_reply
from tests.test_gateway_tokens import make_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GET = b"GET %b HTTP/1.1\r\nHost: t\r\n\r\n"
ServerHandler = Callable[[Request, Responder], Any]


@contextlib.asynccontextmanager
async def serving(handler: ServerHandler, *, max_body: int = 1024, keepalive_s: float = 75.0,
                  deadlines: Deadlines | None = None, max_connections: int | None = None,
                  discard_s: float = 5.0) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(handler, max_body, keepalive_s, discard_s, deadlines=deadlines,
                        max_connections=max_connections)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.close(0)
        await asyncio.sleep(0.01)


def assert_openai_error(body: bytes, status: int) -> dict[str, Any]:
    """The body is an OpenAI-style error of the type `status` calls for; returns its `error` object."""
    error = json.loads(body)
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["message"]
    kinds = {404: "not_found_error", 503: "server_error"}
    assert error["error"]["type"] == kinds.get(status, "invalid_request_error")
    return error["error"]  # type: ignore[no-any-return]


async def trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    """Send `data` one byte at a time, `every_s` apart (until the server closes the connection)."""
    with contextlib.suppress(ConnectionError):
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(every_s)


# -- 1. nothing a client sends reaches the filesystem or an unbounded structure ------------------------------------
@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every tokenizer the gateway tries to load from now on (the only way from a model to a file)."""
    seen: list[str] = []
    real = tokens_module.load

    def spy(source: str | Path, max_bytes: int | None = None) -> Any:
        seen.append(str(source))
        return real(source, max_bytes)

    monkeypatch.setattr(tokens_module, "load", spy)
    return seen


PROBES = ["/etc/passwd", "/proc/self/environ", "/dev/zero", "../../../../etc/shadow", "/tmp", "C:\\Windows\\win.ini"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions", "embeddings", "tokenize-like"])
async def test_model_paths_are_404_and_no_file_is_opened(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                                         loads: list[str], tmp_path: Path, endpoint: str) -> None:
    """Models that are paths (system files, a directory holding a real tokenizer.json) get 404; nothing is loaded."""
    make_tokenizer(tmp_path / "model")
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    path = {"tokenize-like": "/v1/some/other/path"}.get(endpoint, f"/v1/{endpoint}")
    async with aiohttp.ClientSession() as session:
        for model in [*PROBES, str(tmp_path / "model"), str(tmp_path / "model" / "tokenizer.json")]:
            body = {"model": model, "prompt": "hi", "input": "hi", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(gw.url + path, json=body) as resp:
                assert resp.status == 404, model
                error = assert_openai_error(await resp.read(), 404)
                assert error["code"] == "model_not_found" and error["param"] == "model"
    assert loads == [] and len(gw.gateway.counter) == 0
    assert fake.stats.bodies == []  # nor did any reach the replica


async def test_unknown_model_is_404_before_any_per_model_work(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown model is refused before its prompt is counted (the counter is never asked about it)."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    asked: list[str] = []
    real = gw.gateway.counter.counter
    monkeypatch.setattr(gw.gateway.counter, "counter", lambda model, size: asked.append(model) or real(model, size))
    async with aiohttp.ClientSession() as session:
        for model in ("nope", "fake-model"):
            async with session.post(gw.url + "/v1/completions", json={"model": model, "prompt": "x"}) as resp:
                assert resp.status == (404 if model == "nope" else 200)
    assert asked == ["fake-model"]


async def test_flood_of_unknown_models_grows_nothing(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A thousand distinct model names leave the tokenizer table, the metric label sets and /metrics as they were."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    metrics = gw.gateway.metrics
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/completions", json={"model": "fake-model", "prompt": "x"}) as resp:
            assert resp.status == 200
        async with session.get(gw.url + "/metrics") as resp:
            before = await resp.text()
        answers = (dict(metrics._counts), set(metrics._latency), set(metrics._store._index))

        async def probe(i: int) -> int:
            path = random.choice(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/x"])
            body = {"model": f"m-{i}-{'z' * (i % 300)}", "prompt": "p", "input": "p",
                    "messages": [{"role": "user", "content": "p"}]}
            async with session.post(gw.url + path, json=body) as resp:
                return resp.status

        statuses = await asyncio.gather(*(probe(i) for i in range(1000)))
        async with session.get(gw.url + "/metrics") as resp:
            after = await resp.text()
    assert set(statuses) == {404}
    assert len(gw.gateway.counter) == 0
    assert (dict(metrics._counts), set(metrics._latency), set(metrics._store._index)) == answers
    assert "m-1" not in after
    families = lambda text: sorted(re.split(r"[{ ]", line)[0] for line in text.splitlines() if not line.startswith("#"))
    assert families(after) == families(before)  # the same series (404s are not counted as rejections)
    assert len(after) < len(before) + 200


async def test_tokenizer_found_from_a_replica_model_root(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                                         loads: list[str], tmp_path: Path) -> None:
    """A replica whose model card's root is a local directory with a tokenizer.json gets that model counted exactly
    (loaded in the background once a probe reports the card)."""
    tok = make_tokenizer(tmp_path / "model")
    fake = await fake_replica(root=str(tmp_path / "model"))
    gw = await gateway_for([fake.url])
    counter = gw.gateway.counter
    await until(lambda: counter.knows("fake-model"), 5.0)
    assert loads == [str(tmp_path / "model")]
    assert counter.knows("fake-model")
    text = "the quick brown fox"
    assert counter.count("fake-model", text) == len(tok.encode(text).ids)
    await gw.gateway.health.probe_all()  # type: ignore[union-attr]
    await asyncio.sleep(0.1)
    assert len(loads) == 1  # tried once


@pytest.mark.parametrize("root", ["facebook/opt-125m", "relative/dir", "fake-model"])
async def test_model_root_that_is_not_a_local_path_is_not_loaded(fake_replica: FakeFactory,
                                                                 gateway_for: GatewayFactory, loads: list[str],
                                                                 root: str) -> None:
    """A card root that is a hub id or a relative path is left alone."""
    fake = await fake_replica(root=root)
    gw = await gateway_for([fake.url])
    await asyncio.sleep(0.2)  # time enough for the background discovery (the test above takes well under that)
    assert loads == [] and len(gw.gateway.counter) == 0


async def test_tokenizers_found_through_cards_are_bounded(loads: list[str], tmp_path: Path) -> None:
    """A replica listing many models with local roots makes the gateway look for at most MAX_DISCOVERED of them."""
    counter = TokenCounter()
    cards = {f"m{i}": {"id": f"m{i}", "root": str(tmp_path / f"d{i}")} for i in range(MAX_DISCOVERED + 50)}
    await counter.discover(cards)
    await counter.discover(cards)
    assert len(loads) == MAX_DISCOVERED


def test_found_tokenizer_must_be_a_small_regular_file(tmp_path: Path) -> None:
    """A root whose tokenizer.json is a device, a FIFO or too large is not read."""
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "tokenizer.json")  # opening it would block forever
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "tokenizer.json").symlink_to("/dev/zero")
    make_tokenizer(tmp_path / "big")
    assert tokens_module.load(tmp_path / "fifo", 1 << 20) is None
    assert tokens_module.load(tmp_path / "dev", 1 << 20) is None
    assert tokens_module.load(tmp_path / "big", 100) is None
    assert tokens_module.load(tmp_path / "big", 1 << 20) is not None


@pytest.mark.parametrize("workers", [1, 2])
def test_named_tokenizer_that_does_not_exist_is_refused_at_start(tmp_path: Path, workers: int) -> None:
    """`tokenizers:` naming a path that does not exist stops `gateway serve` at start with a message naming it."""
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"replicas": ["http://127.0.0.1:9"], "port": 0, "host": "127.0.0.1",
                                  "workers": workers, "tokenizers": {"m": str(tmp_path / "missing")}}))
    with pytest.raises(ConfigError, match="missing"):
        TokenCounter.from_sources({"m": str(tmp_path / "missing")})
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "bad configuration" in out.stderr and str(tmp_path / "missing") in out.stderr


def test_large_bodies_are_estimated_not_tokenized(tmp_path: Path) -> None:
    """A prompt in a body over EXACT_MAX_BYTES is estimated: the tokenizer's event-loop time per request is bounded."""
    tok = make_tokenizer(tmp_path / "model")
    counter = TokenCounter({"m": tok})
    small = "the quick brown fox " * 10
    big = "the quick brown fox " * (EXACT_MAX_BYTES // 20 + 1)
    for text, expected in ((small, len(tok.encode(small).ids)), (big, estimate(big))):
        raw = json.dumps({"model": "m", "prompt": text, "max_tokens": 1}).encode()
        assert parse(raw, "completions", counter, 16).prompt_tokens == expected


@pytest.mark.parametrize("body", [
    b'{"model": "fake-model", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "fake-model", "prompt": ' + b"[" * 900 + b'"x"' + b"]" * 900 + b"}",
    b'{"model": "fake-model", "prompt": [["a", "b"]]}',
    b'{"model": "fake-model", "prompt": [[1, 2], "a", [[3]]]}',
], ids=["nested-5000", "nested-900", "list-of-lists-of-strings", "ids-nested"])
async def test_deeply_nested_bodies_are_400(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                            body: bytes) -> None:
    """Bodies nested deeper than OpenAI's prompt forms get a 400, never a 500 (RecursionError)."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            assert_openai_error(await resp.read(), 400)


# -- 2. deadlines on slow clients -----------------------------------------------------------------------------------
SHORT = Deadlines(header_s=0.4, body_s=0.4, body_min_rate=100.0, send_s=0.4)
HEAD = b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Pad: " + b"p" * 40 + b"\r\n"


async def timed_408(port: int, send: Callable[[asyncio.StreamWriter], Any]) -> float:
    """Run `send` on a new connection; the seconds until the server answered 408 and closed."""
    async with connect(port) as (reader, writer):
        started = time.monotonic()
        sender = asyncio.create_task(send(writer))
        try:
            reply = await asyncio.wait_for(read_reply(reader), 5.0)
            took = time.monotonic() - started
            assert await read_eof(reader) == b""
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
    assert reply.status == 408 and reply.headers["connection"] == "close"
    assert assert_openai_error(reply.body, 408)["code"] == "request_timeout"
    return took


async def test_slow_loris_head_gets_408() -> None:
    """A head sent a byte at a time, each byte in time, is cut off with 408 once the whole head is past header_s."""
    echo = Echo()
    async with serving(echo, deadlines=SHORT) as (_, port):
        took = await timed_408(port, lambda w: trickle(w, HEAD + b"\r\n", 0.05))
    assert 0.35 <= took < 1.2 and not echo.seen


async def test_slow_body_read_gets_408() -> None:
    """A body that stops arriving for longer than body_s gets 408."""
    async def send(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + b"Content-Length: 10\r\n\r\n12345")
        await asyncio.sleep(10)

    echo = Echo()
    async with serving(echo, deadlines=SHORT) as (_, port):
        took = await timed_408(port, send)
    assert 0.35 <= took < 1.2 and not echo.seen


async def test_body_under_the_minimum_rate_gets_408() -> None:
    """A body trickling in (each read in time, 20 bytes/s under a 100 bytes/s minimum) gets 408 at about
    body_s + bytes / rate."""
    async def send(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + b"Content-Length: 1000\r\n\r\n")
        await trickle(writer, b"x" * 1000, 0.05)

    echo = Echo()
    async with serving(echo, max_body=4096, deadlines=SHORT) as (_, port):
        took = await timed_408(port, send)
    assert 0.45 <= took < 1.5 and not echo.seen  # 0.4 + 20 t / 100 = t at t = 0.5 s


async def test_slow_but_steady_clients_are_served() -> None:
    """A head and a body in several reads, each within the deadlines and above the minimum rate, are answered."""
    echo = Echo()
    body = b"y" * 200
    async with serving(echo, max_body=4096, deadlines=SHORT) as (_, port), connect(port) as (reader, writer):
        head = HEAD + b"Content-Length: %d\r\n\r\n" % len(body)
        for part in (head[:20], head[20:], body[:100], body[100:]):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.1)
        reply = await read_reply(reader)
    assert reply.status == 200 and json.loads(reply.body)["size"] == 200


async def test_silent_connection_closed_after_header_timeout() -> None:
    """A new connection that sends nothing is closed after header_s, even with a long keep-alive."""
    async with serving(Echo(), keepalive_s=30, deadlines=SHORT) as (_, port), connect(port) as (reader, _w):
        started = time.monotonic()
        assert await read_eof(reader) == b""
    assert 0.35 <= time.monotonic() - started < 1.2


async def test_idle_keep_alive_connection_waits_keepalive_not_header_timeout() -> None:
    """Between requests a connection may idle for keepalive_s, longer than header_s."""
    async with serving(Echo(), keepalive_s=1.5, deadlines=SHORT) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/a")
        assert (await read_reply(reader)).status == 200
        await asyncio.sleep(0.8)  # past header_s
        writer.write(GET % b"/b")
        assert (await read_reply(reader)).status == 200


async def test_pipelined_request_waiting_on_the_server_is_not_timed_out() -> None:
    """A request head left half-read because the server paused reading (too much pipelined) is not the client's
    delay: it gets its whole header_s once the server reads again."""
    echo = Echo(delays={"/slow": 1.0})
    body = b"b" * 700
    post = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    async with serving(echo, max_body=1000, deadlines=SHORT) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/slow")
        await asyncio.sleep(0.1)
        writer.write(post * 3 + b"GET /last HTTP/1.1\r\n")  # over max_body queued: the server stops reading
        await asyncio.sleep(0.1)
        writer.write(b"Host: t\r\n\r\n")  # sits unread until the slow answer is done, 0.9 s from now
        replies = [await asyncio.wait_for(read_reply(reader), 5.0) for _ in range(5)]
    assert [r.status for r in replies] == [200] * 5
    assert json.loads(replies[-1].body)["path"] == "/last"


async def test_client_that_stops_reading_a_stream_is_cut_off() -> None:
    """A streamed answer whose client reads nothing for send_s ends: the connection closes, the handler is cancelled."""
    cancelled = asyncio.Event()

    async def flood(request: Request, responder: Responder) -> None:
        responder.start(200, {}, "application/octet-stream")
        try:
            for _ in range(1024):
                await responder.send(b"f" * 65536)
            await responder.finish()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with serving(flood, deadlines=SHORT) as (server, port):
        async with connect(port, rcvbuf=16384) as (_reader, writer):
            writer.write(GET % b"/flood")
            started = time.monotonic()
            await asyncio.wait_for(cancelled.wait(), 3.0)
            took = time.monotonic() - started
            await until(lambda: not server.connections, 1.0)
            assert not server.connections
    assert 0.35 <= took < 1.5


async def test_client_that_does_not_read_a_large_answer_is_cut_off() -> None:
    """A whole (not streamed) answer larger than the socket buffers, never read, does not hold the connection."""
    async def big(request: Request, responder: Responder) -> Response:
        return Response(200, b"z" * (8 << 20), "application/octet-stream")

    async with serving(big, deadlines=SHORT) as (server, port), connect(port, rcvbuf=16384) as (_r, writer):
        writer.write(GET % b"/big")
        await asyncio.sleep(0.1)
        assert len(server.connections) == 1
        await until(lambda: not server.connections, 2.0)
        assert not server.connections


async def test_slow_reader_that_keeps_reading_gets_the_whole_stream() -> None:
    """A client reading a large stream in pauses shorter than send_s gets all of it."""
    chunks = [bytes([i]) * 65536 for i in range(24)]

    async def big(request: Request, responder: Responder) -> None:
        responder.start(200, {}, "application/octet-stream")
        for chunk in chunks:
            await responder.send(chunk)
        await responder.finish()

    async with serving(big, deadlines=SHORT) as (_, port), connect(port, rcvbuf=65536) as (reader, writer):
        writer.write(GET % b"/big")
        received = bytearray()
        async with asyncio.timeout(10):
            while not received.endswith(b"0\r\n\r\n"):
                received += await reader.read(128 * 1024)
                await asyncio.sleep(0.25)  # under send_s, with the buffers full meanwhile
    assert sum(received.count(chunk) for chunk in chunks) == len(chunks)


async def test_slow_reader_of_a_gateway_stream_ends_the_upstream_request(fake_replica: FakeFactory,
                                                                         gateway_for: GatewayFactory) -> None:
    """Through the gateway: a stream nobody reads ends after send_timeout_s, and the replica sees its request
    aborted (vLLM then frees the request's batch slot and KV cache)."""
    fake = await fake_replica()  # unpaced: the socket buffers fill in a moment
    gw = await gateway_for([fake.url], clients={"send_timeout_s": 0.5})
    body = json.dumps({"model": "fake-model", "prompt": "x", "max_tokens": 10**7, "stream": True}).encode()
    async with connect(gw.port, rcvbuf=16384) as (_reader, writer):
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        await until(lambda: fake.stats.aborted == 1, 5.0)
    assert fake.stats.aborted == 1 and fake.stats.finished == 0
    replica = gw.gateway.router.replicas[fake.url]
    assert replica.inflight == 0 and replica.outstanding == 0 and replica.healthy


def test_client_deadlines_are_configurable() -> None:
    """The `clients:` section sets every deadline and the connection cap; bad values are refused, named."""
    from gateway.config import from_mapping

    config = from_mapping({"replicas": ["http://a:1"], "clients": {
        "header_timeout_s": 5, "body_timeout_s": 6, "body_min_bytes_per_s": 7, "send_timeout_s": 8,
        "keepalive_s": 9, "max_connections": 10}})
    assert (config.clients.header_timeout_s, config.clients.max_connections) == (5, 10)
    for bad in ({"header_timeout_s": 0}, {"max_connections": -1}, {"send_timeout_s": "x"}, {"nope": 1}):
        with pytest.raises(ConfigError, match="clients"):
            from_mapping({"replicas": ["http://a:1"], "clients": bad})


# -- 3. resource exhaustion is overload --------------------------------------------------------------------------
async def test_connections_over_the_cap_get_503_with_retry_after() -> None:
    """Past max_connections a new connection's request is answered 503, Retry-After, an OpenAI body, and closed;
    the connections within the cap keep working."""
    sleeper = Sleeper(0.5)
    async with (serving(sleeper, max_connections=2) as (server, port), connect(port) as (r1, w1),
                connect(port) as (r2, w2), connect(port) as (r3, w3)):
        for writer in (w1, w2):
            writer.write(GET % b"/s")
        await asyncio.sleep(0.1)
        w3.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nabcde")
        refused = await read_reply(r3)
        assert await read_eof(r3) == b""
        served = [await read_reply(r) for r in (r1, r2)]
    assert refused.status == 503 and refused.headers["retry-after"] == "1"
    assert refused.headers["connection"] == "close"
    assert assert_openai_error(refused.body, 503)["code"] == "server_overloaded"
    assert [r.status for r in served] == [200, 200]


async def test_connections_beyond_the_refusals_wait_in_the_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cap and the refusal slots full, the server stops accepting; a waiting client is served once a
    connection closes, and the server never holds more than max_connections + REFUSING connections."""
    monkeypatch.setattr(server_module, "REFUSING", 1)
    echo = Echo()
    async with serving(echo, max_connections=1) as (server, port):
        async with connect(port) as (r1, w1), connect(port) as (_r2, _w2):  # served (idle) and refusing (silent)
            await asyncio.sleep(0.1)
            assert len(server.connections) == 2
            async with connect(port) as (r3, w3):
                w3.write(GET % b"/waiting")
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(r3.readuntil(b"\r\n\r\n"), 0.3)
                assert len(server.connections) == 2
                w1.close()
                reply = await read_reply(r3)  # accepted once the first connection closed, and served
        assert reply.status == 200 and json.loads(reply.body)["path"] == "/waiting"


class FailingOnce:
    """A listening socket whose first accept() fails with `code`."""

    def __init__(self, sock: Any, code: int) -> None:
        self.sock, self.code = sock, code

    def fileno(self) -> int:
        return int(self.sock.fileno())

    def close(self) -> None:
        self.sock.close()

    def accept(self) -> Any:
        if self.code:
            code, self.code = self.code, 0
            raise OSError(code, os.strerror(code))
        return self.sock.accept()


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOBUFS])
async def test_accept_failures_are_overload(code: int) -> None:
    """accept() out of descriptors: the spare one answers that client 503 + Retry-After; out of buffers: accepting
    pauses briefly and the client is served. Either way the server accepts again afterwards."""
    async with serving(Echo()) as (server, port):
        server._pause_accepting()
        server._listeners = [FailingOnce(server._listeners[0], code)]  # type: ignore[list-item]
        server._resume_accepting()
        async with connect(port) as (reader, writer):
            writer.write(GET % b"/first")
            first = await read_reply(reader)
        async with connect(port) as (reader, writer):
            writer.write(GET % b"/second")
            second = await read_reply(reader)
        assert server._spare is not None  # taken back
    if code == errno.EMFILE:
        assert first.status == 503 and first.headers["retry-after"] == "1"
        assert assert_openai_error(first.body, 503)["code"] == "server_overloaded"
    else:
        assert first.status == 200
    assert second.status == 200


async def test_out_of_descriptors_in_a_handler_is_503() -> None:
    """A handler failing with EMFILE gets its client a 503 with Retry-After, not a 500; the connection serves on."""
    async def handler(request: Request, responder: Responder) -> Response:
        if request.path == "/emfile":
            raise OSError(errno.EMFILE, "Too many open files")
        return Response(200, b"{}")

    async with serving(handler) as (_, port), connect(port) as (reader, writer):
        writer.write(GET % b"/emfile" + GET % b"/fine")
        first, second = await read_reply(reader), await read_reply(reader)
    assert first.status == 503 and first.headers["retry-after"] == "1"
    assert assert_openai_error(first.body, 503)["code"] == "server_overloaded"
    assert second.status == 200


async def test_out_of_descriptors_connecting_upstream_is_503(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE opening a connection to a replica: 503 with Retry-After, no retry, and the replica is not ejected."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    pool = gw.gateway._pool
    assert pool is not None

    async def no_descriptor(origin: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(pool, "_connect", no_descriptor)
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/completions", json={"model": "fake-model", "prompt": "x"}) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert assert_openai_error(await resp.read(), 503)["code"] == "server_overloaded"
        async with session.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    assert gw.gateway.router.replicas[fake.url].healthy
    assert "gateway_retries_total{" not in metrics


async def test_out_of_descriptors_probing_keeps_the_replica(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A health probe failing with EMFILE says nothing about the replica: it stays healthy."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    health = gw.gateway.health
    assert health is not None

    def no_descriptor(*args: object, **kwargs: object) -> None:
        raise aiohttp.ClientOSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(health._session, "get", no_descriptor)
    await health.probe_all()
    assert gw.gateway.router.replicas[fake.url].healthy


def test_max_connections_derived_from_the_descriptor_limit() -> None:
    """The default cap leaves RESERVED descriptors and two per connection (its own and one to a replica)."""
    assert default_max_connections(256) == (256 - RESERVED) // 2 == 96
    assert default_max_connections(1 << 20) == ((1 << 20) - RESERVED) // 2
    assert default_max_connections(10) == 1


# -- the real `gateway serve` under a low descriptor limit, in a subprocess ---------------------------------------
def _limit(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.asynccontextmanager
async def gateway_process(tmp_path: Path, replica: str, soft: int, hard: int,
                          **settings: Any) -> AsyncIterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """`gateway serve` under RLIMIT_NOFILE (soft, hard); yields its URL, process and log file."""
    config, log = tmp_path / "gateway.yaml", tmp_path / "gateway.log"
    config.write_text(json.dumps({"replicas": [replica], "host": "127.0.0.1", "port": 0,
                                  "health": {"interval_s": 0.5, "timeout_s": 2}, **settings}))
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit(soft, hard))
    try:
        url = ""
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(30):
                while not url:
                    assert proc.poll() is None, log.read_text()
                    found = re.search(r"gateway on 127\.0\.0\.1:(\d+)", log.read_text())
                    url = f"http://127.0.0.1:{found.group(1)}" if found else ""
                    await asyncio.sleep(0.05)
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(url + "/ready") as resp:
                            if resp.status == 200:
                                break
                    await asyncio.sleep(0.05)
        yield url, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


STREAM = {"model": "fake-model", "prompt": "x", "max_tokens": 20, "stream": True}


async def stream_outcome(session: aiohttp.ClientSession, url: str) -> str:
    """'served' (a whole stream), 'refused' (503, Retry-After, OpenAI body), or what else happened."""
    try:
        async with session.post(url + "/v1/completions", json=STREAM) as resp:
            body = await resp.read()
            if resp.status == 200 and body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == 21:
                return "served"
            if resp.status == 503 and resp.headers.get("Retry-After") == "1":
                assert_openai_error(body, 503)
                return "refused"
            return f"status {resp.status}: {body[:200]!r}"
    except aiohttp.ClientError as exc:
        return f"error {exc!r}"


async def many_streams(url: str, count: int) -> dict[str, int]:
    """`count` streams at once, each on its own connection; how many ended how."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        outcomes = await asyncio.gather(*(stream_outcome(session, url) for _ in range(count)))
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


@pytest.mark.parametrize("max_connections", [None, 1000], ids=["derived-cap", "cap-above-the-limit"])
async def test_300_streams_under_ulimit_256_are_served_or_refused_cleanly(
        fake_replica: FakeFactory, tmp_path: Path, max_connections: int | None) -> None:
    """The issue's case: `gateway serve` under `ulimit -n 256`, 300 concurrent streams. Each is served whole or
    refused with 503 + Retry-After + an OpenAI body: no 500, no reset, no traceback; afterwards it serves again.
    With the derived cap it stays under the limit; with a cap set above what the limit allows, it runs out of
    descriptors (accept and connect fail with EMFILE) and still only serves or refuses."""
    fake = await fake_replica(itl_s=0.05)
    settings = {"clients": {"max_connections": max_connections}} if max_connections else {}
    async with gateway_process(tmp_path, fake.url, 256, 256, **settings) as (url, proc, log):
        counts = await many_streams(url, 300)
        again = await many_streams(url, 1)
        assert proc.poll() is None
    text = log.read_text()
    assert set(counts) <= {"served", "refused"}, counts
    assert again == {"served": 1}
    assert "Traceback" not in text and "internal gateway error" not in text
    if max_connections is None:  # the cap (96) keeps it within its descriptors: it serves what it can
        assert counts.get("served", 0) >= 50 and counts.get("refused", 0) >= 50, counts
        assert "accepting up to 96 client connections" in text
        assert "out of file descriptors" not in text
    else:  # how many it serves depends on when the descriptors run out; none fails uncleanly
        assert counts.get("refused", 0) >= 1, counts
        assert "out of file descriptors (Too many open files)" in text  # in accept()


async def test_gateway_raises_its_soft_descriptor_limit_at_start(fake_replica: FakeFactory, tmp_path: Path) -> None:
    """Started with a soft limit of 300 under a hard limit of 4096, the gateway runs at 4096 and says so."""
    fake = await fake_replica()
    async with gateway_process(tmp_path, fake.url, 300, 4096) as (_, proc, log):
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
    assert re.search(r"Max open files\s+4096\s+4096", limits), limits
    text = log.read_text()
    assert "file descriptors: soft limit 4096 (was 300), hard limit 4096" in text
    assert f"accepting up to {(4096 - RESERVED) // 2} client connections" in text


async def test_workers_inherit_the_raised_limit_and_cap_connections_each(fake_replica: FakeFactory,
                                                                          tmp_path: Path) -> None:
    """With --workers 2 the supervisor raises the limit before starting the workers; each worker has it and caps
    its own connections (the cap is per worker)."""
    fake = await fake_replica()
    async with gateway_process(tmp_path, fake.url, 300, 4096, workers=2) as (_, proc, log):
        text = log.read_text()
        pids = [int(p) for p in re.search(r"pids ([\d, ]+)", text).group(1).split(", ")]  # type: ignore[union-attr]
        limits = [Path(f"/proc/{pid}/limits").read_text() for pid in pids]
    assert len(pids) == 2 and proc.pid not in pids
    assert all(re.search(r"Max open files\s+4096\s+4096", lim) for lim in limits)
    assert text.count("file descriptors: soft limit 4096 (was 300)") == 1  # once, in the supervisor
    assert text.count(f"accepting up to {(4096 - RESERVED) // 2} client connections") == 2


def test_raise_fd_limit_in_process() -> None:
    """raise_fd_limit leaves the soft limit at the hard one (this process: already there, or raised)."""
    limit = raise_fd_limit()
    assert limit.soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert limit.soft == limit.hard or limit.hard == resource.RLIM_INFINITY


async def test_pipelined_bodies_are_bounded_per_connection() -> None:
    """A client pipelining many large bodies behind a slow request is no longer read once more than max_body of
    them wait: the server holds about twice max_body per connection (plus what one read brought), not all the
    client sends; all are answered in the end."""
    echo = Echo(delays={"/slow": 0.5})
    body = b"b" * 700
    post = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    async with serving(echo, max_body=1000) as (server, port), connect(port) as (reader, writer):
        writer.write(GET % b"/slow")
        for _ in range(40):  # one at a time: what one read brings is parsed whole, however much it is
            writer.write(post)
            await writer.drain()
            await asyncio.sleep(0.002)
        (conn,) = server.connections
        assert conn._reading_paused and conn._queued <= 2 * 1000 and len(conn._queue) <= 3
        replies = [await asyncio.wait_for(read_reply(reader), 5.0) for _ in range(41)]
    assert [r.status for r in replies] == [200] * 41


# -- 4. who can reach what ----------------------------------------------------------------------------------------
def test_exposure_defaults() -> None:
    """The gateway listens on every interface by default; `deploy up` binds the replicas to 127.0.0.1 only."""
    from deploy.launch import gateway_config
    from deploy.plan import Plan, ReplicaSpec
    from deploy.process import vllm_argv
    from deploy.up import UpConfig
    from gateway.config import from_mapping

    assert from_mapping({"replicas": ["http://a:1"]}).host == "0.0.0.0"
    assert UpConfig.__dataclass_fields__["replica_host"].default == "127.0.0.1"
    plan = Plan(model="m", replicas=(ReplicaSpec("a", "m", 8001), ReplicaSpec("b", "m", 8002)))
    argv = vllm_argv(plan.replicas[0])
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    config = gateway_config(plan)
    assert config["host"] == "0.0.0.0"
    assert [r["url"] for r in config["replicas"]] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


async def test_keys_guard_v1_and_never_reach_the_replicas(aiohttp_server: Any, gateway_for: GatewayFactory) -> None:
    """With api_keys, /v1/* (and vLLM's /tokenize and the like) needs a key while /health, /ready and /metrics stay
    open; what reaches a replica is the method, path, body (re-framed with a Content-Length), Content-Type, the
    request id and the upstream key: not the client's key, cookies or other headers."""
    from aiohttp import web

    from tests.fake_replica import FakeBehavior, make_app

    app = make_app(FakeBehavior())
    seen: list[dict[str, str]] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/completions":
            seen.append(dict(request.headers))
        return await handler(request)  # type: ignore[no-any-return]

    app.middlewares.append(record)
    fake = await aiohttp_server(app)
    gw = await gateway_for([str(fake.make_url("")).rstrip("/")], api_keys=["sk-client"],
                           upstream_api_key="sk-upstream")
    async with aiohttp.ClientSession() as session:
        for path in ("/health", "/ready", "/metrics"):
            async with session.get(gw.url + path) as resp:
                assert resp.status == 200, path
        async with session.get(gw.url + "/v1/models") as resp:
            assert resp.status == 401
        for path in ("/tokenize", "/v1/%6Dodels"):  # vLLM's own API that the gateway proxies; a path encoded
            async with session.post(URL(gw.url + path, encoded=True), json={"prompt": "x"}) as resp:
                assert resp.status == 401, path
        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"model": "fake-model", '
            yield b'"prompt": "x", "max_tokens": 2}'

        headers = {"Authorization": "Bearer sk-client", "Cookie": "session=secret", "X-Forwarded-For": "6.6.6.6",
                   "X-Custom": "1", "Content-Type": "application/json"}
        async with session.post(gw.url + "/v1/completions", data=chunks(), headers=headers) as resp:
            assert resp.status == 200
            assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
    (upstream,) = seen
    assert upstream["Authorization"] == "Bearer sk-upstream"
    assert {k.lower() for k in upstream} == {"host", "content-length", "x-request-id", "content-type", "authorization"}
    assert int(upstream["Content-Length"]) == len(b'{"model": "fake-model", "prompt": "x", "max_tokens": 2}')


async def test_requests_import_and_open_nothing(fake_replica: FakeFactory, tmp_path: Path) -> None:
    """Once started, serving every kind of request (and error, and health probe) imports no module and opens no
    file: Python's audit hooks see neither, so nothing on a request's path needs a free file descriptor but its
    sockets."""
    fake = await fake_replica()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tests.audit_runner", fake.url, cwd=ROOT,
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            port = int(await proc.stdout.readline())
            assert (await proc.stdout.readline()).strip() == b"armed"
        url = f"http://127.0.0.1:{port}"
        completion = {"model": "fake-model", "prompt": "x", "max_tokens": 3}
        async with aiohttp.ClientSession() as session:
            for method, path, body in [
                ("POST", "/v1/completions", completion), ("POST", "/v1/completions", {**completion, "stream": True}),
                ("POST", "/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                                                  "stream": True}),
                ("POST", "/v1/embeddings", {"model": "fake-model", "input": ["a", "b"]}),
                ("POST", "/v1/completions", {"model": "/etc/passwd", "prompt": "x"}),
                ("POST", "/v1/completions", {"model": "fake-model"}), ("POST", "/v1/other", {"model": "fake-model"}),
                ("GET", "/v1/completions", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
                ("GET", "/ready", None), ("GET", "/health", None), ("GET", "/nope", None),
            ]:
                async with session.request(method, url + path, json=body) as resp:
                    await resp.read()
                    assert resp.status < 500, (path, resp.status)
            async with session.post(url + "/v1/completions", data=b"[" * 5000) as resp:
                assert resp.status == 400
            async with session.post(url + "/v1/completions", data=io.BytesIO(b"x" * (5 << 20))) as resp:
                assert resp.status == 413
        async with connect(port) as (reader, writer):
            writer.write(b"NOT HTTP\r\n\r\n")
            assert (await read_reply(reader)).status == 400
        await asyncio.sleep(0.5)  # a few health probes
    finally:
        proc.stdin.close()
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    events = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    # /metrics's process_* series (prometheus-client's ProcessCollector) read /proc/self: fixed paths, never a
    # client's data, and out of descriptors the collector leaves those series out (it catches OSError), not a 500.
    assert [e for e in events if not e[1].startswith("('/proc/self/")] == []


async def test_https_replicas_ca_bundle_is_read_at_start(gateway_for: GatewayFactory) -> None:
    """With an https replica, the TLS context (the system CA bundle) is built at start, not by the first request."""
    gw = await gateway_for(["https://127.0.0.1:9"])
    assert gw.gateway._pool is not None and gw.gateway._pool._ssl is not None


def test_overload_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """A warning every request would repeat under overload is logged at most once a second, with a count."""
    import logging

    from gateway.limits import Throttled

    throttled = Throttled(logging.getLogger("test.throttled"), interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        for _ in range(1000):
            throttled.warning("out of %s", "descriptors")
        time.sleep(0.25)
        throttled.warning("out of %s", "descriptors")
    assert [r.getMessage() for r in caplog.records] == [
        "out of descriptors (1 time(s) since the last such warning)",
        "out of descriptors (1000 time(s) since the last such warning)"]
