"""`gateway serve --workers N`: a small supervisor and N worker processes accepting on one port.

Like uvicorn's multiprocess supervisor and gunicorn's arbiter, the parent serves no request. It binds the port,
runs the control plane (health probes, DNS discovery, load feedback: once, not N times), starts the workers,
restarts one that dies (after zeroing its row of the load table, which releases every reservation it held), and
forwards signals: SIGTERM or SIGINT drains every worker (requests in flight get `GRACE_S`), SIGHUP reloads the
config file's replicas and replaces the workers one by one (a new one serves before the old one drains), so any
other changed setting takes effect without a dropped connection. The workers know nothing of each other: they
share only the load table (gateway/table.py).

Sockets: on Linux each worker position gets its own listening socket, all bound to the port with SO_REUSEPORT
(nginx's `reuseport`): the kernel spreads new connections evenly over the workers, with no thundering herd on
one accept queue. The parent keeps every socket open, so a worker that dies leaves the connections queued for
it to its replacement (they wait well under a second) instead of having them reset, and a replacement on SIGHUP
takes over the same socket. Elsewhere (no load-balancing SO_REUSEPORT) all workers share one socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .admin import AdminApi
from .config import GatewayConfig, to_mapping
from .control import ControlPlane
from .discovery import Resolver
from .server import HttpServer
from .table import H_HI, H_RESTARTS, R_HEARTBEAT, R_STATE, STATE_READY, LoadTable

logger = logging.getLogger(__name__)

GRACE_S = 30.0  # requests in flight when a worker is told to stop
START_TIMEOUT_S = 60.0  # a worker that does not serve by then is killed and started again
HEARTBEAT_TIMEOUT_S = 30.0  # a worker whose event loop has not ticked for this long is killed and restarted
TICK_S = 0.1
BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)  # between restarts of a worker that keeps dying at once


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one port (SO_REUSEPORT on Linux), or one socket `count` times elsewhere."""
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    reuseport = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
    first = _listen(family, address, reuseport)
    if not reuseport:
        return [first] * count
    bound = (address[0], first.getsockname()[1], *address[2:])  # port 0: every socket on the port the first got
    return [first] + [_listen(family, bound, reuseport) for _ in range(count - 1)]


def _listen(family: socket.AddressFamily, address: tuple[object, ...], reuseport: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class _Worker:
    position: int  # which listening socket it accepts on
    row: int  # its row of the load table
    process: asyncio.subprocess.Process
    started: float
    ready: bool = False
    leaving: bool = False  # told to stop: not restarted when it exits


class Supervisor:
    """Starts, watches and restarts the workers; runs the control plane; forwards signals."""

    def __init__(self, config: GatewayConfig, reload: Callable[[], GatewayConfig] | None = None,
                 resolver: Resolver | None = None) -> None:
        self.config = config
        self._reload = reload
        self.table = LoadTable.create(rows=1 + 2 * config.workers, shared=True)  # room to replace all on SIGHUP
        self.control = ControlPlane(config, self.table, range(1, self.table.rows), resolver)
        self.sockets = listen_sockets(config.host, config.port, config.workers)
        self.port = int(self.sockets[0].getsockname()[1])
        self._admin_dir = tempfile.TemporaryDirectory(prefix="gateway-admin-")  # mode 0700: ours alone
        self.admin_socket = str(Path(self._admin_dir.name) / "admin.sock")
        self.workers: dict[int, _Worker] = {}  # by row
        self._failures: dict[int, int] = {}  # quick deaths in a row, by position
        self._starting: set[int] = set()
        self._stopping = False

    async def run(self, stop: asyncio.Event, hup: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set, then drain every worker; `hup` set: reload and replace the workers."""
        await self.control.start()
        admin = await self._serve_admin()
        try:
            await asyncio.gather(*(self._start(p) for p in range(self.config.workers)))
            if not all(w.ready for w in self.workers.values()):
                raise SystemExit("gateway: a worker failed to start (its log is above); stopping")
            logger.info("gateway on %s:%d: %d workers (pids %s), policy %s", self.config.host, self.port,
                        len(self.workers), ", ".join(str(w.process.pid) for w in self.workers.values()),
                        self.config.policy)
            while not stop.is_set():
                if hup is not None and hup.is_set():
                    hup.clear()
                    await self._replace_all()
                await self._watch()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), TICK_S)
        finally:
            await self._stop_all()
            await admin.close(0)
            self._admin_dir.cleanup()
            await self.control.stop()
            for sock in set(self.sockets):
                sock.close()
            if self.table.fd is not None:
                os.close(self.table.fd)

    # -- starting -----------------------------------------------------------------------------------------------
    async def _serve_admin(self) -> HttpServer:
        """The admin API on a Unix socket in a private directory: workers pass /admin/* requests on to it."""
        server = HttpServer(AdminApi(self.control).handle, max_body=65536)
        await server.start_unix(self.admin_socket)
        return server

    async def _start(self, position: int) -> _Worker:
        row = next(r for r in range(1, self.table.rows) if r not in self.workers and r not in self._starting)
        self._starting.add(row)  # workers start side by side: no two may take one row
        self.table.clear_row(row)
        self.table.cells[H_HI] = max(int(self.table.cells[H_HI]), row + 1)  # readers include it before it serves
        sock = self.sockets[position]
        spec = {"config": to_mapping(self.config), "row": row, "table_fd": self.table.fd,
                "socket_fd": sock.fileno(), "parent": os.getpid(), "admin_socket": self.admin_socket}
        assert self.table.fd is not None
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.worker", stdin=asyncio.subprocess.PIPE,
                pass_fds=(self.table.fd, sock.fileno()))
            worker = self.workers[row] = _Worker(position, row, process, time.monotonic())
        finally:
            self._starting.discard(row)
        assert process.stdin is not None
        process.stdin.write(json.dumps(spec).encode())
        await process.stdin.drain()
        process.stdin.close()
        await self._until_ready(worker)
        return worker

    async def _until_ready(self, worker: _Worker) -> None:
        state = self.table.head_cell(worker.row, R_STATE)
        while self.table.cells[state] != STATE_READY:
            if worker.process.returncode is not None:
                return  # died while starting: _watch restarts it
            if time.monotonic() - worker.started > START_TIMEOUT_S:
                logger.error("worker %d did not start serving in %g s: killing it", worker.process.pid,
                             START_TIMEOUT_S)
                self._kill(worker)
                return
            await asyncio.sleep(0.02)
        worker.ready = True

    # -- watching -----------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Restart the workers that died; kill the ones whose event loop stopped ticking."""
        now = time.monotonic()
        for worker in list(self.workers.values()):
            code = worker.process.returncode
            if code is None:
                beat = self.table.floats[self.table.head_cell(worker.row, R_HEARTBEAT)]
                if worker.ready and beat and now - beat > HEARTBEAT_TIMEOUT_S:
                    logger.error("worker %d has not ticked for %.0f s: killing it", worker.process.pid, now - beat)
                    self._kill(worker)
                continue
            del self.workers[worker.row]
            self.table.clear_row(worker.row)  # its reservations, queue and ejections go with it
            if worker.leaving or self._stopping:
                continue
            logger.error("worker %d exited with %s: releasing its reservations and starting another",
                         worker.process.pid, _status(code))
            self.table.cells[H_RESTARTS] += 1
            quick = now - worker.started < 5.0
            failures = self._failures[worker.position] = self._failures.get(worker.position, 0) + 1 if quick else 0
            if failures:
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])
            await self._start(worker.position)

    def _kill(self, worker: _Worker) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()

    # -- SIGHUP and stopping ------------------------------------------------------------------------------------
    async def _replace_all(self) -> None:
        """Reload the config (replicas at once), then replace each worker: the new one serves, the old one drains."""
        if self._reload is not None:
            try:
                config = self._reload()
            except ValueError as exc:
                logger.error("SIGHUP: the new configuration is not valid, keeping the old one: %s", exc)
                return
            if config.workers != self.config.workers or (config.host, config.port) != (self.config.host,
                                                                                        self.config.port):
                logger.warning("SIGHUP: the worker count and the address change only with a restart")
                config = self._keep_shape(config)
            self.control.reload(config)
            self.config = config
        logger.info("SIGHUP: replacing the %d workers one by one", len(self.workers))
        for old in [w for w in self.workers.values() if not w.leaving]:
            await self._start(old.position)
            old.leaving = True
            with contextlib.suppress(ProcessLookupError):
                old.process.send_signal(signal.SIGTERM)

    def _keep_shape(self, config: GatewayConfig) -> GatewayConfig:
        from dataclasses import replace

        return replace(config, workers=self.config.workers, host=self.config.host, port=self.config.port)

    async def _stop_all(self) -> None:
        """SIGTERM to every worker (each drains), stop accepting, wait; kill what outlives the grace period."""
        self._stopping = True
        for worker in self.workers.values():
            worker.leaving = True
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        for sock in set(self.sockets):
            sock.close()  # the workers hold their own copies until they stop listening
        deadline = time.monotonic() + GRACE_S + 5.0
        for worker in list(self.workers.values()):
            try:
                await asyncio.wait_for(worker.process.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                logger.error("worker %d did not stop in time: killing it", worker.process.pid)
                self._kill(worker)
                await worker.process.wait()
        self.workers.clear()


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"


def serve_workers(config: GatewayConfig, reload: Callable[[], GatewayConfig] | None = None) -> None:
    """Run the supervisor until SIGTERM or SIGINT (the CLI's entry point for `--workers` above 1)."""
    asyncio.run(_supervise(config, reload))


async def _supervise(config: GatewayConfig, reload: Callable[[], GatewayConfig] | None) -> None:
    stop, hup = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, hup.set)
    supervisor = Supervisor(config, reload)
    await supervisor.run(stop, hup)
    logger.info("stopped")
