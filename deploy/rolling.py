"""`deploy restart --rolling`: restart the replicas one at a time without failing a request.

For each replica in turn: drain it in the gateway (admin API: no new requests; it leaves the gateway's set once
its requests are done), have `deploy up` restart it (deploy/control.py), wait until it is healthy, add it back to
the gateway as the gateway's config file lists it, and wait until the gateway probes it healthy. The other
replicas serve meanwhile, so at least two are needed. `--replica NAME` (repeatable) restarts only those, in the
deployment's order (one wedged or given new settings, say), the others untouched.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy import control
from deploy import state as run_state

logger = logging.getLogger(__name__)


class RollingError(RuntimeError):
    """The rolling restart cannot go on; the message says where it stopped and why."""


@dataclass(frozen=True)
class RollingConfig:
    """Where the deployment runs, and how long each step may take."""

    run_dir: Path
    drain_timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    admit_timeout_s: float = 60.0
    poll_s: float = 0.5
    only: tuple[str, ...] = ()  # these replicas (by name) and no other; empty: every one


class Admin:
    """The gateway's admin API."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url.rstrip("/") + "/admin/replicas"
        self._key = key

    def call(self, method: str, path: str = "", body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self._key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status), json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), json.loads(exc.read() or b"{}")


def _wait(condition: Callable[[], bool], timeout_s: float, poll_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RollingError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(poll_s)


def rolling_restart(config: RollingConfig, say: Callable[[str], None] = print) -> None:
    """Drain, restart and re-admit every replica of the deployment in `config.run_dir` (or those `config.only`
    names), one after another."""
    state = run_state.read(config.run_dir)
    if not run_state.is_running(state) or state.gateway is None:
        raise RollingError(f"no deployment runs with run directory {str(config.run_dir)!r}")
    if len(state.replicas) < 2:
        raise RollingError("a rolling restart needs at least two replicas (the others serve while one restarts)")
    names = [r.name for r in state.replicas]
    if unknown := [n for n in config.only if n not in names]:
        raise RollingError(f"no replica named {', '.join(unknown)} in this deployment (its replicas: "
                           f"{', '.join(names)})")
    admin = Admin(state.gateway.url, control.admin_key(config.run_dir))
    listed = {r["name"]: r for r in yaml.safe_load((config.run_dir / "gateway.yaml").read_text())["replicas"]
              if isinstance(r, dict) and "name" in r}
    for replica in (r for r in state.replicas if not config.only or r.name in config.only):
        if replica.name not in listed:
            raise RollingError(f"replica {replica.name} is not in the gateway's config file")
        started = time.monotonic()
        _one(config, admin, replica.name, listed[replica.name], say)
        say(f"deploy: replica {replica.name} restarted and back in the gateway ({time.monotonic() - started:.0f} s)")


def _one(config: RollingConfig, admin: Admin, name: str, entry: dict[str, Any], say: Callable[[str], None]) -> None:
    status, view = admin.call("POST", f"/{name}/drain")
    if status == 202:
        say(f"deploy: draining {name} ({view['inflight_requests']} request(s) in flight there)")
        _wait(lambda: admin.call("GET", f"/{name}")[0] == 404, config.drain_timeout_s, config.poll_s,
              f"{name} finishing its requests")
    elif status != 404:  # 404: not in the gateway's set (removed before): restart it all the same
        raise RollingError(f"draining {name}: the gateway answered {status}: {view}")
    old = _replica(config.run_dir, name)
    control.request_restart(config.run_dir, name)

    def back() -> bool:
        now = _replica(config.run_dir, name)
        return now.pid != old.pid and now.status == "running" and now.healthy
    say(f"deploy: restarting {name}")
    _wait(back, config.start_timeout_s, config.poll_s, f"{name} restarting and becoming healthy")
    status, view = admin.call("POST", body=entry)
    if status not in (201, 409):  # 409: back already (a config reload re-added it, say)
        raise RollingError(f"adding {name} back: the gateway answered {status}: {view}")
    _wait(lambda: bool(admin.call("GET", f"/{name}")[1].get("healthy")), config.admit_timeout_s, config.poll_s,
          f"the gateway taking {name} back")


def _replica(run_dir: Path, name: str) -> run_state.ProcessState:
    state = run_state.read(run_dir)
    if not run_state.is_running(state):
        raise RollingError("the deployment stopped during the rolling restart")
    return next(r for r in state.replicas if r.name == name)
