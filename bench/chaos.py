"""Fault injection for the soak (bench/soak.py): a proxy in front of each replica, and the replicas' processes.

`Injector` is a TCP proxy between the gateway and one replica that parses the HTTP requests passing through, logs
each one it receives (keyed by `x-request-id`, on the machine's monotonic clock) and, on demand, answers them with
500s, resets the connection (before the answer, or after its first bytes), or slows the answer ten times (every
byte is released at ten times its delay since the request). Like vLLM's server (uvicorn), it closes a keep-alive
connection idle for `idle_close_s`. It never freezes or dies itself, so its log is exact whatever the replica
behind it does.

`ReplicaProcess` is one replica in its own process group, killed with SIGKILL and restarted, or frozen with
SIGSTOP and resumed with SIGCONT. `FaultPlan` draws when each fault happens, to which replica, for how long.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httptools

MODES = ("pass", "error", "reset", "slow")
_ERROR_BODY = json.dumps({"error": {"message": "injected failure", "type": "InternalServerError", "param": None,
                                    "code": 500}}).encode()
_ERROR = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
          % (len(_ERROR_BODY), _ERROR_BODY))


@dataclass(frozen=True)
class Receipt:
    """One request as a replica's injector received it."""

    request_id: str
    replica: int
    at: float  # time.monotonic()
    path: str


class Injector:
    """A proxy in front of one replica: logs the requests it receives, and fails or slows them on demand."""

    def __init__(self, index: int, upstream_port: int, receipts: list[Receipt], *, slow_factor: float = 10.0,
                 idle_close_s: float = 5.0, rng: random.Random | None = None) -> None:
        self.index = index
        self.upstream_port = upstream_port
        self.receipts = receipts
        self.slow_factor = slow_factor
        self.idle_close_s = idle_close_s
        self.rng = rng or random.Random(index)
        self.mode = "pass"
        self.port = 0
        self.connections: set[_Downstream] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1") -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Downstream(self), host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()


class _Downstream(asyncio.Protocol):
    """The gateway's side of one connection through an injector."""

    def __init__(self, injector: Injector) -> None:
        self.injector = injector
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._raw = bytearray()
        self._request_id = ""
        self._url = b""
        self._complete = False
        self._upstream: _Upstream | None = None
        self._connecting = False
        self._pending: deque[bytes] = deque()
        self.busy = False  # a request is waiting for (the rest of) its answer
        self.mode = "pass"  # the mode the current request got
        self.sent_at = 0.0
        self.release_at = 0.0  # slow mode: when the last byte passed on may go out
        self.reset_after_first = False
        self._last = self._loop.time()
        self._idle = self._loop.call_later(injector.idle_close_s, self._check_idle)

    # -- from the gateway -----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.injector.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._last = self._loop.time()
        self._raw += data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.abort()
            return
        if self._complete:
            self._complete = False
            raw, self._raw = bytes(self._raw), bytearray()
            self._handle(raw)

    def on_message_begin(self) -> None:
        self._request_id, self._url = "", b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self._request_id = value.decode("latin-1")

    def on_message_complete(self) -> None:
        self._complete = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.injector.connections.discard(self)
        self._idle.cancel()
        if self._upstream is not None:
            self._upstream.close()

    def _handle(self, raw: bytes) -> None:
        injector = self.injector
        now = time.monotonic()
        if self._request_id:
            injector.receipts.append(Receipt(self._request_id, injector.index, now, self._url.decode("latin-1")))
        self.mode = injector.mode
        self.busy = True
        if self.mode == "error":
            self._write_now(_ERROR)
            self.busy = False
            return
        if self.mode == "reset":
            if injector.rng.random() < 0.5:
                self.abort()
                return
            self.reset_after_first = True
        self.sent_at = self.release_at = self._loop.time()
        self._send_upstream(raw)

    # -- to the replica -------------------------------------------------------------------------------------------
    def _send_upstream(self, raw: bytes) -> None:
        if self._upstream is not None and self._upstream.transport is not None:
            self._upstream.transport.write(raw)
            return
        self._pending.append(raw)
        if not self._connecting:
            self._connecting = True
            self._loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            _, upstream = await asyncio.wait_for(self._loop.create_connection(
                lambda: _Upstream(self), "127.0.0.1", self.injector.upstream_port), timeout=2.0)
        except (OSError, TimeoutError):
            self.abort()  # the replica is down: the gateway sees a reset before any byte, as from a dead replica
            return
        finally:
            self._connecting = False
        self._upstream = upstream
        assert upstream.transport is not None
        while self._pending:
            upstream.transport.write(self._pending.popleft())

    # -- back to the gateway --------------------------------------------------------------------------------------
    def from_upstream(self, data: bytes, answer_done: bool) -> None:
        """Bytes of the replica's answer; `answer_done`: they end it."""
        if self.mode == "slow":
            now = self._loop.time()
            self.release_at = max(self.release_at, self.sent_at + self.injector.slow_factor * (now - self.sent_at))
            self._loop.call_at(self.release_at, self._write_now, data, answer_done)
            return
        self._write_now(data, answer_done)
        if self.reset_after_first:
            self.abort()

    def upstream_closed(self, reset: bool) -> None:
        if self.mode == "slow":
            self._loop.call_at(self.release_at, self.abort if reset else self.close)
        elif reset:
            self.abort()
        else:
            self.close()

    def _write_now(self, data: bytes, answer_done: bool = False) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
            self._last = self._loop.time()
        if answer_done:
            self.busy = False
            self.reset_after_first = False

    def _check_idle(self) -> None:
        if not self.busy and self._loop.time() - self._last >= self.injector.idle_close_s:
            self.close()
            return
        self._idle = self._loop.call_later(self.injector.idle_close_s / 4, self._check_idle)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Reset the connection (RST, as a process that dies does), not a clean close."""
        if self._transport is None or self._transport.is_closing():
            return
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._transport.abort()


class _Upstream(asyncio.Protocol):
    """The injector's connection to the replica: answers go back through the downstream side."""

    def __init__(self, downstream: _Downstream) -> None:
        self.downstream = downstream
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._done = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            pass  # passed on as it came: the gateway judges the replica's answer, not the injector
        self.downstream.from_upstream(data, self._done)

    def on_message_complete(self) -> None:
        self._done = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.downstream.upstream_closed(reset=exc is not None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# -- the replicas' processes ---------------------------------------------------------------------------------------
def spawn(argv: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start `argv` in its own process group (signals reach its children too), appending its output to `log_path`."""
    with log_path.open("ab") as log:
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


class ReplicaProcess:
    """One replica's process (`argv`), in its own process group, logging to `log_path`."""

    def __init__(self, index: int, port: int, argv: Sequence[str], log_path: Path) -> None:
        self.index = index
        self.port = port
        self.argv = list(argv)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = spawn(self.argv, self.log_path)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.healthy):
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.index} exited while starting; log {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.index} not healthy within {timeout_s:g} s; log {self.log_path}")
            await asyncio.sleep(0.1)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        """SIGCONT then SIGTERM (a frozen process cannot act on SIGTERM), SIGKILL after 5 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.thaw()
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


# -- when faults happen --------------------------------------------------------------------------------------------
FAULT_KINDS = ("kill", "freeze", "error", "reset", "slow")


@dataclass(frozen=True)
class Fault:
    """One fault: what, to which replica, from `start_s` into the run, for `duration_s`."""

    kind: str
    replica: int
    start_s: float
    duration_s: float


def fault_plan(duration_s: float, replicas: int, rng: random.Random, quiet_tail_s: float) -> list[Fault]:
    """Every kind of fault once per cycle of about two minutes, in a random order, each on a random replica.

    Faults do not overlap (one replica at a time is harmed); nothing happens in the first 8% of the run (a
    baseline) or in the last `quiet_tail_s` (recovery).
    """
    start, end = 0.08 * duration_s, duration_s - quiet_tail_s
    cycles = max(1, round(duration_s / 120))
    slot = (end - start) / (cycles * len(FAULT_KINDS))
    faults: list[Fault] = []
    for cycle in range(cycles):
        kinds = list(FAULT_KINDS)
        rng.shuffle(kinds)
        if cycle == cycles - 1 and kinds.index("slow") > 1:  # a slowed answer takes ten times as long (a minute):
            at = kinds.index("slow")                           # early in the last cycle, so the run ends soon
            kinds[0], kinds[at] = kinds[at], kinds[0]
        for i, kind in enumerate(kinds):
            at = start + (cycle * len(FAULT_KINDS) + i + rng.uniform(0.0, 0.1)) * slot
            faults.append(Fault(kind, rng.randrange(replicas), at, rng.uniform(0.5, 0.85) * slot))
    return faults
