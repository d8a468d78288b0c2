"""Requests to a running `deploy up` from another command, as files in its run directory.

`deploy restart --rolling` asks `deploy up` (which owns the replicas' processes) to restart one replica by
writing `requests/restart-<name>`; `deploy up` takes the file on its next tick (every 0.5 s), restarts the
replica, and shows it in `state.json` as starting, then running. The run directory also holds the gateway's admin
key (`admin.key`, mode 0600), which the admin API wants.
"""

from __future__ import annotations

import os
from pathlib import Path

REQUESTS_DIR = "requests"
ADMIN_KEY_FILE = "admin.key"
_RESTART = "restart-"


def request_restart(run_dir: Path, name: str) -> None:
    """Ask the `deploy up` running in `run_dir` to restart replica `name`."""
    folder = run_dir / REQUESTS_DIR
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{_RESTART}{name}.tmp"
    tmp.write_text(name)
    os.replace(tmp, folder / f"{_RESTART}{name}")  # whole or not at all for the reader


def take_restarts(run_dir: Path) -> list[str]:
    """The replicas asked to restart since the last call (the requests are removed)."""
    folder = run_dir / REQUESTS_DIR
    if not folder.is_dir():
        return []
    names = []
    for path in sorted(folder.glob(f"{_RESTART}*")):
        names.append(path.name[len(_RESTART):])
        path.unlink(missing_ok=True)
    return names


def admin_key(run_dir: Path) -> str:
    """The gateway's admin key, as `deploy up` wrote it."""
    try:
        return (run_dir / ADMIN_KEY_FILE).read_text().strip()
    except OSError as exc:
        raise ValueError(f"no admin key in {str(run_dir)!r} ({exc.strerror}): was it started by this version of "
                         "`deploy up`?") from exc
