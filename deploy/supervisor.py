"""Keep processes running: restart the dead ones with exponential backoff, one start at a time.

The supervisor only restarts; the gateway stops sending traffic to a replica that fails its health probes
and takes it back once healthy. Everything happens in `tick()`, called by the owner every fraction of a
second, so tests drive it with a fake clock and fake processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from deploy.state import ProcessState

logger = logging.getLogger(__name__)


class Supervised(Protocol):
    """What the supervisor needs of a process (ManagedProcess / VllmServer fit)."""

    name: str
    log_path: Path

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def poll(self) -> int | None: ...

    def healthy(self, timeout_s: float = 2.0) -> bool: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Backoff:
    """Delay before restart number n after consecutive failures: initial * factor**(n-1), capped."""

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 60.0
    reset_after_s: float = 60.0  # healthy this long: the failure count starts over

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.factor < 1 or self.max_s < self.initial_s or self.reset_after_s <= 0:
            raise ValueError(f"bad backoff {self!r}")

    def delay(self, failures: int) -> float:
        return float(min(self.max_s, self.initial_s * self.factor ** max(0, failures - 1)))


class Slot:
    """The supervisor's book on one process: what it is doing and how often it failed."""

    def __init__(self, proc: Supervised, url: str, status: str = "running", now: float = 0.0) -> None:
        self.proc = proc
        self.url = url
        self.status = status  # running | starting | backoff | stopped
        self.healthy = status == "running"
        self.healthy_since: float | None = now if self.healthy else None
        self.failures = 0
        self.restarts = 0
        self.next_start_at = 0.0
        self.started_at = now
        self.last_probe_at = now
        self.log_size: int | None = None  # while starting: the log's size when it last grew, and when
        self.log_grew_at = now

    def view(self) -> ProcessState:
        pid = self.proc.pid if self.status in ("running", "starting") else None
        return ProcessState(name=self.proc.name, url=self.url, pid=pid, healthy=self.healthy,
                            restarts=self.restarts, log=str(self.proc.log_path), status=self.status)


class Supervisor:
    """Restarts processes that die, with backoff, starting at most one at a time."""

    def __init__(self, backoff: Backoff = Backoff(), *, startup_timeout_s: float = 600.0, probe_interval_s: float = 2.0,
                 probe_timeout_s: float = 1.0, silent_start_s: float | None = 180.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff = backoff
        self.startup_timeout_s = startup_timeout_s
        # A start whose log stays silent this long is wedged (vLLM logs every phase of its start-up, and a progress
        # bar while it loads weights): stopped and retried long before the startup timeout. None: never.
        self.silent_start_s = silent_start_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self.slots: list[Slot] = []

    def add(self, proc: Supervised, url: str) -> Slot:
        """Watch a process that is already running and healthy."""
        slot = Slot(proc, url, now=self.clock())
        self.slots.append(slot)
        return slot

    def views(self) -> tuple[ProcessState, ...]:
        return tuple(s.view() for s in self.slots)

    def tick(self) -> bool:
        """Look at every process once; return whether anything a status reader sees changed."""
        before = self.views()
        for slot in self.slots:
            {"running": self._running, "starting": self._starting, "backoff": self._backoff}.get(
                slot.status, lambda s: None)(slot)
        return self.views() != before

    def restart(self, name: str) -> bool:
        """Stop the process called `name` (SIGTERM, then SIGKILL past its grace) and start it again at once.

        A restart asked for (`deploy restart --rolling`), not a failure: no backoff, and the failure count stays.
        """
        slot = next((s for s in self.slots if s.proc.name == name), None)
        if slot is None:
            logger.warning("restart of %s asked for, but no process has that name", name)
            return False
        slot.proc.stop()
        self._start(slot)
        slot.healthy, slot.healthy_since = False, None
        logger.info("%s restarted on request (restart %d), pid %s", name, slot.restarts, slot.proc.pid)
        return True

    def stop_all(self, order: Sequence[Slot] | None = None) -> None:
        """Stop every process (in `order`, default: last added first)."""
        for slot in order if order is not None else reversed(self.slots):
            slot.proc.stop()
            slot.status, slot.healthy = "stopped", False

    def _failed(self, slot: Slot, why: str) -> None:
        slot.failures += 1
        delay = self.backoff.delay(slot.failures)
        slot.status, slot.healthy, slot.healthy_since = "backoff", False, None
        slot.next_start_at = self.clock() + delay
        logger.warning("%s %s; restarting in %.1f s (failure %d in a row), log %s", slot.proc.name, why, delay,
                       slot.failures, slot.proc.log_path)

    def _running(self, slot: Slot) -> None:
        code = slot.proc.poll()
        if code is not None:
            self._failed(slot, f"exited with code {code}")
            return
        now = self.clock()
        if now - slot.last_probe_at < self.probe_interval_s:
            return
        slot.last_probe_at = now
        healthy = slot.proc.healthy(self.probe_timeout_s)
        if healthy and not slot.healthy:
            slot.healthy_since = now
        if not healthy:
            slot.healthy_since = None
        slot.healthy = healthy
        if healthy and slot.failures and slot.healthy_since is not None \
                and now - slot.healthy_since >= self.backoff.reset_after_s:
            slot.failures = 0

    def _starting(self, slot: Slot) -> None:
        code = slot.proc.poll()
        if code is not None:
            self._failed(slot, f"exited with code {code} while starting")
        elif slot.proc.healthy(self.probe_timeout_s):
            now = self.clock()
            slot.status, slot.healthy, slot.healthy_since, slot.last_probe_at = "running", True, now, now
            logger.info("%s is back (restart %d), pid %s", slot.proc.name, slot.restarts, slot.proc.pid)
        elif self.clock() - slot.started_at > self.startup_timeout_s:
            slot.proc.stop()
            self._failed(slot, f"was not healthy within {self.startup_timeout_s:g} s of its start")
        elif self._silent(slot):
            state = _process_state(slot.proc.pid)  # before the stop: where it was stuck, for the log
            slot.proc.stop()
            self._failed(slot, f"logged nothing for {self.silent_start_s:g} s while starting (wedged: {state})")

    def _start(self, slot: Slot) -> None:
        slot.proc.start()
        slot.restarts += 1
        slot.status, slot.started_at = "starting", self.clock()
        slot.log_size, slot.log_grew_at = _size(slot.proc.log_path), slot.started_at

    def _silent(self, slot: Slot) -> bool:
        if self.silent_start_s is None:
            return False
        size, now = _size(slot.proc.log_path), self.clock()
        if size != slot.log_size:
            slot.log_size, slot.log_grew_at = size, now
        return now - slot.log_grew_at > self.silent_start_s

    def _backoff(self, slot: Slot) -> None:
        # One start at a time: vLLM instances sharing a GPU profile memory wrongly when they start together.
        if self.clock() < slot.next_start_at or any(s.status == "starting" for s in self.slots):
            return
        slot.proc.stop()  # reap the dead leader and anything left in its group
        self._start(slot)
        logger.info("%s restarted (restart %d), pid %s", slot.proc.name, slot.restarts, slot.proc.pid)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _process_state(pid: int | None) -> str:
    """A process's scheduler state and kernel wait channel, from /proc (Linux), for a log line."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError as exc:
        return f"pid {pid}: {exc.strerror}"
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "?")
    return f"pid {pid} state {state}, waiting in {wchan or '-'}"
