"""Running the packaged locustfile headless in a subprocess, and reading back what it wrote.

Locust is never imported here (it gevent-patches the interpreter); it runs as `python -m locust`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.config import LoadConfig, to_argv
from loadtest.records import META_FILE, RECORDS_FILE, RequestRecord, read_records

logger = logging.getLogger(__name__)

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
LOG_FILE = "locust.log"
RUN_TIME_MARGIN_S = 30.0  # Locust's own run-time limit, past the schedule and the drain: a safety net
KILL_GRACE_S = 10.0


class RunFailed(Exception):
    """The Locust subprocess did not finish its run."""


@dataclass(frozen=True)
class RunOutput:
    """What the locustfile left in the output directory."""

    records: list[RequestRecord]
    meta: dict[str, Any]


def run_time_limit(config: LoadConfig) -> float | None:
    """Seconds after which Locust stops by itself, None for an open-ended closed-loop run."""
    if math.isinf(config.arrival.duration):
        return None
    return config.arrival.duration + config.drain_timeout + RUN_TIME_MARGIN_S


def locust_command(config: LoadConfig, out: Path) -> list[str]:
    """The `python -m locust` command line that runs `config`, writing into `out`."""
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "1", "-r", "1",
            "-H", config.hosts[0], "--hosts", ",".join(config.hosts), "--out", str(out),
            "--csv", str(out / "locust"), "--csv-full-history", "--html", str(out / "locust.html"),
            "--exit-code-on-error", "0", "--stop-timeout", str(int(KILL_GRACE_S))]
    limit = run_time_limit(config)
    if limit is not None:
        argv += ["-t", f"{math.ceil(limit)}s"]
    return argv + to_argv(config)


@contextmanager
def _process_group(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start `argv` in its own process group, logging to `log`; the group dies with the context."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield proc
        finally:
            if proc.poll() is None:
                _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def run_locust(config: LoadConfig, out: Path) -> RunOutput:
    """Run `config` through Locust headless; raises RunFailed when it does not finish."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in (META_FILE, RECORDS_FILE):
        (out / stale).unlink(missing_ok=True)
    argv = locust_command(config, out)
    limit = run_time_limit(config)
    logger.info("running: %s", " ".join(argv))
    with _process_group(argv, out / LOG_FILE) as proc:
        try:
            code = proc.wait(timeout=None if limit is None else limit + RUN_TIME_MARGIN_S)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"locust did not exit in time; see {out / LOG_FILE}") from None
    if code != 0:
        raise RunFailed(f"locust exited with status {code}; see {out / LOG_FILE}:\n{_tail(out / LOG_FILE)}")
    return read_output(out)


def read_output(out: Path) -> RunOutput:
    """The records and meta.json the locustfile wrote into `out`."""
    meta_path = out / META_FILE
    if not meta_path.exists():
        raise RunFailed(f"the load test did not start: no {meta_path}; see {out / LOG_FILE}:\n{_tail(out / LOG_FILE)}")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if not meta.get("finished"):
        raise RunFailed(f"the load test did not finish; see {out / LOG_FILE}:\n{_tail(out / LOG_FILE)}")
    records_path = out / RECORDS_FILE
    return RunOutput(read_records(records_path) if records_path.exists() else [], meta)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
