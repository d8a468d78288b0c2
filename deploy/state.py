"""The run state `deploy up` keeps in its run directory and `deploy status` reads.

One JSON file, `state.json`, rewritten atomically (write a temporary file, then rename) whenever something
changes, so a reader never sees half a file:

    {"pid": 1234, "started_at": 1700000000.0, "updated_at": ..., "device": "cpu", "model": "tiny-opt",
     "gateway": {"name": "gateway", "url": "http://127.0.0.1:8000", "pid": 1301, "healthy": true,
                 "restarts": 0, "log": "/.../logs/gateway.log", "status": "running"},
     "replicas": [{"name": "r0", "url": "http://127.0.0.1:8001", ...}, ...]}
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"


class StateError(ValueError):
    """The state file is missing or unreadable; the message names it."""


@dataclass(frozen=True)
class ProcessState:
    """One supervised process as `deploy status` shows it."""

    name: str
    url: str
    pid: int | None
    healthy: bool
    restarts: int
    log: str
    status: str  # starting | running | restarting | backoff | stopped | failed


@dataclass(frozen=True)
class RunState:
    """A whole deployment: who runs it, the gateway and the replicas."""

    pid: int
    started_at: float
    device: str
    model: str
    gateway: ProcessState | None
    replicas: tuple[ProcessState, ...]
    updated_at: float = field(default_factory=time.time)
    stopped: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["replicas"] = list(data["replicas"])
        return data


def default_run_dir() -> Path:
    """$SMALLSERVE_RUN_DIR, else ~/.cache/smallserve/run."""
    env = os.environ.get("SMALLSERVE_RUN_DIR")
    return Path(env) if env else Path.home() / ".cache" / "smallserve" / "run"


def write(run_dir: Path, state: RunState) -> None:
    """Replace the state file atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state-", suffix=".json", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state.to_dict(), f, indent=2)
        os.replace(tmp, run_dir / STATE_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _process(data: Any) -> ProcessState:
    return ProcessState(**data)


def read(run_dir: Path) -> RunState:
    """Read the state file of the deployment in `run_dir`."""
    path = run_dir / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise StateError(f"no deployment state in {str(run_dir)!r} (is `deploy up` running with this --run-dir?)") \
            from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise StateError(f"cannot read {str(path)!r}: {exc}") from exc
    try:
        return RunState(
            pid=int(data["pid"]), started_at=float(data["started_at"]), device=str(data["device"]),
            model=str(data["model"]),
            gateway=_process(data["gateway"]) if data.get("gateway") else None,
            replicas=tuple(_process(r) for r in data["replicas"]),
            updated_at=float(data["updated_at"]), stopped=bool(data.get("stopped", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"{str(path)!r} is not a deployment state file: {exc}") from exc


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_running(state: RunState) -> bool:
    """Whether the `deploy up` that wrote this state still runs."""
    return not state.stopped and pid_alive(state.pid)


def format_table(state: RunState) -> str:
    """A human-readable view of the state."""
    running = is_running(state)
    when = (f"up {time.time() - state.started_at:.0f} s" if running else
            f"stopped at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(state.updated_at))}")
    head = (f"deployment pid {state.pid} ({'running' if running else 'NOT running'}), device {state.device}, "
            f"model {state.model}, {when}")
    rows = [("NAME", "URL", "PID", "STATUS", "HEALTHY", "RESTARTS", "LOG")]
    procs = ([state.gateway] if state.gateway else []) + list(state.replicas)
    for p in procs:
        rows.append((p.name, p.url, str(p.pid or "-"), p.status if running else "stopped",
                     "yes" if p.healthy and running else "no", str(p.restarts), p.log))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    return "\n".join([head, *lines])
