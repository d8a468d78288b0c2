"""Processes that own their process group: a vLLM server, the gateway, anything with a health URL.

    with VllmServer(spec, log_path, env) as server:      # started, and /health answered 200
        ...server.url...
    # the whole process group is gone here: SIGTERM, then SIGKILL after `stop_grace_s`

Each process is started in a new session (its own process group), so stopping it reaches every child
it made (vLLM's engine core, its workers) and nothing else. `wait_ready` fails fast with `ProcessDied`
when the process exits while we wait, and with `StartupTimeout` when it is not healthy in time.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol

from deploy.plan import ReplicaSpec

logger = logging.getLogger(__name__)

POLL_S = 0.5
# How far below normal CPU priority a vLLM replica runs: on a machine it shares with the gateway and load
# generators, they come first (docs/deploy.md, "CPU priority"). 0: as any process.
REPLICA_NICE = 10


class ProcessError(RuntimeError):
    """A managed process failed to start or to become healthy; the message says which and why."""


class ProcessDied(ProcessError):
    """The process exited while we waited for it to become healthy."""


class StartupTimeout(ProcessError):
    """The process did not become healthy in time."""


class Cancelled(ProcessError):
    """The wait was cancelled (the `cancel` event was set, e.g. by a SIGTERM handler)."""


class CancelToken(Protocol):
    """Something a wait can be cancelled through: a `StopFlag` or a `threading.Event`."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class StopFlag:
    """A flag a signal handler may set: no lock, unlike `threading.Event` (whose lock a handler can deadlock on)."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until set or `timeout` seconds pass; return whether it is set."""
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while not self._set and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._set


def probe(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET `url` answers 200 within `timeout_s`; anything that is not an HTTP 200 answer is a no.

    A probe that connected to itself (deploy/ports.py) reads its own request back as a bad status line.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file ('' when unreadable)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


def group_alive(pgid: int) -> bool:
    """Whether any process is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _confined(cpus: frozenset[int]) -> Iterator[None]:
    """Within: this thread (and so a child it starts, which inherits the mask) may run on `cpus` only."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def lower_priority(pid: int, nice: int) -> None:
    """Run process `pid`, and what it starts from now on, `nice` steps below normal CPU priority.

    Two settings, for two kinds of kernel: the process's own nice value (its threads and children inherit it), and
    its session's autogroup's. Where the kernel groups threads by session (CONFIG_SCHED_AUTOGROUP, on by default on
    desktop and many cloud kernels), a session's threads share one weight against other sessions', and a nice value
    only orders threads within the session: only the autogroup's nice puts another session first.
    """
    if nice == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except FileNotFoundError:
        pass  # no autogroup in this kernel (or not Linux): the nice value alone orders it
    except ProcessLookupError:
        pass  # it exited at once: wait_ready reports that, with its log
    except OSError as exc:  # a read-only /proc in some containers: it runs, at normal priority
        logger.warning("could not lower the CPU priority of pid %d to nice %d: %s", pid, nice, exc)


class ManagedProcess:
    """A command run in its own process group, logged to a file, healthy when `health_url` answers 200; `nice`
    steps below normal CPU priority (`lower_priority`)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: str | Path, health_url: str,
                 env: Mapping[str, str] | None = None, *, startup_timeout_s: float = 600.0,
                 stop_grace_s: float = 10.0, cpus: Sequence[int] = (), nice: int = 0) -> None:
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be 0-19, got {nice!r}")
        self.name = name
        self.argv = tuple(argv)
        self.log_path = Path(log_path)
        self.health_url = health_url
        self.env = dict(os.environ if env is None else env)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.cpus = frozenset(cpus)  # the cores it may run on (inherited by its children); empty: any
        self.nice = nice
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Start the process (not waiting for health); the log file is appended to."""
        if self.running():
            raise ProcessError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            with _confined(self.cpus):
                self._proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        lower_priority(self._proc.pid, self.nice)  # at once: the threads and children it starts inherit it
        logger.info("%s started, pid %d, log %s", self.name, self._proc.pid, self.log_path)

    def poll(self) -> int | None:
        """The exit code if the process has exited, else None (also None when never started)."""
        return self._proc.poll() if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the process runs and its health URL answers 200."""
        return self.running() and probe(self.health_url, timeout_s)

    def wait_ready(self, timeout_s: float | None = None, cancel: CancelToken | None = None) -> None:
        """Block until healthy; raise ProcessDied at once if the process exits, StartupTimeout after `timeout_s`.

        Setting `cancel` (from a signal handler or another thread) ends the wait with Cancelled.
        """
        cancel = cancel or StopFlag()
        limit = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            code = self.poll()
            if self._proc is None or code is not None:
                raise ProcessDied(f"{self.name} exited with code {code} before it was healthy; "
                                  f"log {self.log_path}:\n{tail(self.log_path)}")
            if probe(self.health_url, timeout_s=min(2.0, max(0.1, deadline - time.monotonic()))):
                logger.info("%s is healthy at %s", self.name, self.health_url)
                return
            if time.monotonic() >= deadline:
                raise StartupTimeout(f"{self.name} was not healthy at {self.health_url} within {limit:g} s; "
                                     f"log {self.log_path}:\n{tail(self.log_path)}")
            if cancel.wait(POLL_S):
                raise Cancelled(f"{self.name}: startup cancelled")

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after the grace period. Idempotent."""
        if self._proc is None:
            return
        pgid = self._proc.pid  # start_new_session: the leader's pid is the group id
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        while time.monotonic() < deadline:
            self._proc.poll()  # reap the leader, or it stays in the group as a zombie
            if not group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            logger.warning("%s (group %d) still running %g s after SIGTERM: SIGKILL", self.name, pgid,
                           self.stop_grace_s)
            self._signal_group(pgid, signal.SIGKILL)
        self._proc.wait()
        logger.info("%s stopped (exit code %s)", self.name, self._proc.returncode)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ManagedProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def vllm_argv(spec: ReplicaSpec, host: str = "127.0.0.1", python: str = sys.executable) -> list[str]:
    """The command line that starts vLLM's OpenAI server for one replica."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
            "--host", host, "--port", str(spec.port)]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
    if spec.max_loras is not None:
        argv += ["--enable-lora", "--max-loras", str(spec.max_loras)]
        if spec.max_lora_rank is not None:
            argv += ["--max-lora-rank", str(spec.max_lora_rank)]
    return argv + list(spec.extra_args)


def vllm_env(spec: ReplicaSpec, env: Mapping[str, str] | None = None, *, flashinfer: bool = True) -> dict[str, str]:
    """The environment for one replica: `env` (default: ours) plus the CPU KV cache size the spec names,
    runtime adapter loading when it serves LoRA, and, where its Python lacks `flashinfer` (the offline
    wheelhouse leaves it out; `VllmServer` asks only for a GPU replica, one given a GPU memory share), vLLM's own
    top-k/top-p sampler: vLLM 0.26's GPU model runner imports flashinfer
    when it builds its sampler unless VLLM_USE_FLASHINFER_SAMPLER=0, and fails to start without it (seen on
    the first GPU run). A value already in `env` is kept."""
    result = dict(os.environ if env is None else env)
    if not flashinfer:
        result.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if spec.cpu_kvcache_space_gib is not None:
        # vLLM reads VLLM_CPU_KVCACHE_SPACE as a whole number of GiB.
        result["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(spec.cpu_kvcache_space_gib)))
    if spec.max_loras is not None:
        result["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter: the gateway loads on demand
    return result


def has_module(python: str, name: str, timeout_s: float = 10.0) -> bool:
    """Whether `python` can import top-level module `name` (found, not imported: nothing of it runs)."""
    if python == sys.executable:
        return importlib.util.find_spec(name) is not None
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], timeout=timeout_s, capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class VllmServer(ManagedProcess):
    """One vLLM OpenAI server for `spec`, in its own process group, `nice` below normal CPU priority (default
    REPLICA_NICE: the gateway and clients on its machine come first); a context manager.

    `with VllmServer(spec, log_path, env) as s:` returns once `/health` is 200 (or raises ProcessDied /
    StartupTimeout, having stopped what it started) and kills the whole group on exit.
    """

    def __init__(self, spec: ReplicaSpec, log_path: str | Path, env: Mapping[str, str] | None = None, *,
                 host: str = "127.0.0.1", startup_timeout_s: float = 600.0, stop_grace_s: float = 10.0,
                 python: str = sys.executable, cpus: Sequence[int] = (), nice: int = REPLICA_NICE) -> None:
        probe_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.spec = spec
        self.url = f"http://{probe_host}:{spec.port}"
        gpu = spec.gpu_memory_utilization is not None or spec.kv_cache_memory_bytes is not None
        env_for = vllm_env(spec, env, flashinfer=not gpu or has_module(python, "flashinfer"))
        super().__init__(spec.name, vllm_argv(spec, host, python), log_path, f"{self.url}/health",
                         env_for, startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s,
                         cpus=cpus, nice=nice)

    def __enter__(self) -> VllmServer:
        super().__enter__()
        return self
