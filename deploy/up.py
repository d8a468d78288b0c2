"""`deploy up`: start the replicas one by one, then the gateway; supervise; stop everything on SIGTERM/Ctrl-C.

Everything started is entered into one ExitStack, so whatever way `run` ends (a signal, a replica that
never got healthy, a bug) every process group it started is stopped, in reverse order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deploy import control
from deploy import state as run_state
from deploy.control import ADMIN_KEY_FILE
from deploy.hardware import Hardware
from deploy.launch import Launch, gateway_config, local_tokenizers
from deploy.mps import MpsDaemon
from deploy.plan import Plan
from deploy.ports import port_bound
from deploy.process import REPLICA_NICE, CancelToken, ManagedProcess, ProcessError, VllmServer, probe
from deploy.supervisor import Backoff, Slot, Supervisor

logger = logging.getLogger(__name__)

TICK_S = 0.5
STATE_REFRESH_S = 5.0


class DeployError(RuntimeError):
    """`deploy up` cannot go on; the message says why."""


@dataclass(frozen=True)
class UpConfig:
    """Everything `deploy up` needs, decided before anything starts."""

    plan: Plan
    launches: tuple[Launch, ...]
    hardware: Hardware
    run_dir: Path
    model_label: str
    host: str = "0.0.0.0"  # the gateway's listen address
    replica_host: str = "127.0.0.1"
    mps: bool = False
    startup_timeout_s: float = 600.0
    silent_start_s: float | None = 180.0  # a restart whose log stays silent this long is retried (None: never)
    stop_grace_s: float = 10.0
    replica_nice: int = REPLICA_NICE  # replicas run this far below normal CPU priority (0: as the gateway)
    backoff: Backoff = field(default_factory=Backoff)
    base_env: Mapping[str, str] | None = None  # default: this process's environment
    python: str = sys.executable
    log_level: str = "info"
    admin_key: str | None = None  # the gateway's admin API key (default: a new random one, in run_dir/admin.key)


def check_ports(config: UpConfig) -> None:
    for spec in config.plan.replicas:
        if port_bound(spec.port, config.replica_host):
            raise DeployError(f"port {spec.port} (replica {spec.name}) is already in use")
    if port_bound(config.plan.gateway.port, config.host if config.host not in ("", "::") else "0.0.0.0"):
        raise DeployError(f"port {config.plan.gateway.port} (gateway) is already in use")


def check_not_running(run_dir: Path) -> None:
    try:
        previous = run_state.read(run_dir)
    except run_state.StateError:
        return
    if run_state.is_running(previous) and previous.pid != os.getpid():
        raise DeployError(f"a deployment (pid {previous.pid}) already runs with run directory {str(run_dir)!r}; "
                          "stop it (`deploy down`) or give another --run-dir")


def gateway_process(config: UpConfig, env: Mapping[str, str]) -> tuple[ManagedProcess, str]:
    """The gateway subprocess, its config written to the run directory; and its URL."""
    key = config.admin_key or secrets.token_urlsafe(24)
    data = gateway_config(config.plan, host=config.host, replica_host=config.replica_host,
                          tokenizers=local_tokenizers(config.plan), log_level=config.log_level, admin_key=key)
    path = config.run_dir / "gateway.yaml"
    write_private(path, yaml.safe_dump(data, sort_keys=False))  # it holds the admin key
    write_private(config.run_dir / ADMIN_KEY_FILE, key + "\n")  # for `deploy restart --rolling`
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    url = f"http://{local}:{config.plan.gateway.port}"
    argv = [config.python, "-m", "gateway.cli", "serve", "--config", str(path)]
    proc = ManagedProcess("gateway", argv, config.run_dir / "logs" / "gateway.log", f"{url}/health", env,
                          startup_timeout_s=60.0, stop_grace_s=config.stop_grace_s)
    return proc, url


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds a key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)


def wait_url(url: str, timeout_s: float, cancel: CancelToken) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cancel.is_set():
        if probe(url, 1.0):
            return True
        cancel.wait(TICK_S)
    return False


class Deployment:
    """The running deployment: its supervisor, and the state file it keeps current."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.supervisor = Supervisor(config.backoff, startup_timeout_s=config.startup_timeout_s,
                                     silent_start_s=config.silent_start_s)
        self.started_at = time.time()
        self.gateway_url: str | None = None
        self.stopped = False

    def write_state(self) -> None:
        views = self.supervisor.views()
        gateway = next((v for v in views if v.name == "gateway"), None)
        replicas = tuple(v for v in views if v.name != "gateway")
        run_state.write(self.config.run_dir, run_state.RunState(
            pid=os.getpid(), started_at=self.started_at, device=self.config.hardware.device,
            model=self.config.model_label, gateway=gateway, replicas=replicas, stopped=self.stopped))

    def start(self, stack: contextlib.ExitStack, cancel: CancelToken) -> None:
        """Start the replicas (one after another where `Hardware.starts_one_at_a_time`, else at once), then the
        gateway."""
        config = self.config
        base = dict(os.environ if config.base_env is None else config.base_env)
        extra: dict[str, str] = {}
        if config.mps:
            extra = stack.enter_context(MpsDaemon(config.run_dir)).env()
        starting: list[tuple[VllmServer, Slot, float]] = []
        for launch in config.launches:
            env = {**base, **extra, **launch.env}
            server = VllmServer(launch.spec, config.run_dir / "logs" / f"{launch.spec.name}.log", env,
                                host=config.replica_host, startup_timeout_s=config.startup_timeout_s,
                                stop_grace_s=config.stop_grace_s, python=config.python, cpus=launch.cpus,
                                nice=config.replica_nice)
            print(f"deploy: starting replica {launch.spec.name} on {server.url} (log {server.log_path})",
                  file=sys.stderr, flush=True)
            stack.callback(server.stop)
            server.start()
            slot = self.supervisor.add(server, server.url)
            slot.status = "starting"
            self.write_state()
            starting.append((server, slot, time.monotonic()))
            if config.hardware.starts_one_at_a_time:
                self.wait_healthy(starting.pop(), cancel)
        for started in starting:
            self.wait_healthy(started, cancel)
        gateway, url = gateway_process(config, base)
        stack.callback(gateway.stop)
        gateway.start()
        gateway.wait_ready(cancel=cancel)
        self.supervisor.add(gateway, url)
        self.gateway_url = url
        if not wait_url(f"{url}/ready", 30.0, cancel):
            logger.warning("the gateway at %s is not ready (no healthy replica) after 30 s", url)
        self.write_state()

    def wait_healthy(self, started: tuple[VllmServer, Slot, float], cancel: CancelToken) -> None:
        server, slot, at = started
        server.wait_ready(cancel=cancel)
        slot.status, slot.healthy = "running", True
        print(f"deploy: replica {server.name} healthy after {time.monotonic() - at:.0f} s", file=sys.stderr,
              flush=True)
        self.write_state()

    def supervise(self, cancel: CancelToken) -> None:
        """Restart what dies until `cancel` is set; keep the state file current."""
        last_write = time.monotonic()
        while not cancel.wait(TICK_S):
            for name in control.take_restarts(self.config.run_dir):
                self.supervisor.restart(name)
            changed = self.supervisor.tick()
            if changed or time.monotonic() - last_write > STATE_REFRESH_S:
                self.write_state()
                last_write = time.monotonic()


def run(config: UpConfig, cancel: CancelToken) -> None:
    """Run the deployment until `cancel` is set; everything started is stopped before this returns."""
    check_not_running(config.run_dir)
    check_ports(config)
    config.run_dir.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(config)
    try:
        with contextlib.ExitStack() as stack:
            try:
                deployment.start(stack, cancel)
            except ProcessError as exc:
                if cancel.is_set():
                    return
                raise DeployError(str(exc)) from exc
            print_ready(config, deployment.gateway_url or "")
            deployment.supervise(cancel)
            print("deploy: stopping (gateway, then replicas)", file=sys.stderr, flush=True)
    finally:
        deployment.stopped = True
        for slot in deployment.supervisor.slots:
            slot.status, slot.healthy = "stopped", False
        deployment.write_state()


def print_ready(config: UpConfig, url: str) -> None:
    """Tell the user where the deployment answers and how to call it."""
    models = sorted({s.served_model_name or s.model for s in config.plan.replicas})
    model = next((m.name for m in config.plan.models if m.kind == "generate"), models[0])
    served = f"\n  models:  {', '.join(models)} (each request goes to its `model`'s replicas)" if len(models) > 1 else ""
    print(f"""
deploy: {len(config.plan.replicas)} replica(s) of {config.model_label} ({config.hardware.device}) behind the gateway at {url}{served}
  status:  deploy status --run-dir {config.run_dir}
  curl:    curl {url}/v1/completions -H 'Content-Type: application/json' \\
             -d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}'
  openai:  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}], max_tokens=16).choices[0].message.content)"
  stop:    Ctrl-C (or SIGTERM to pid {os.getpid()}, or `deploy down --run-dir {config.run_dir}`)
""", flush=True)
