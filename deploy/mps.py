"""NVIDIA MPS (Multi-Process Service): lets the replicas' kernels share the GPU's SMs concurrently.

`deploy up --mps` starts a control daemon private to the run directory (its own pipe and log directories, so
it never touches a daemon someone else runs), passes the same directories to the replicas, and tells the
daemon to quit when the deployment stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
TIMEOUT_S = 10.0


class MpsDaemon:
    """A context manager that runs an MPS control daemon when one can be run (else: a warning, no-op)."""

    def __init__(self, run_dir: Path, control: str = CONTROL) -> None:
        self.pipe_dir = run_dir / "mps" / "pipe"
        self.log_dir = run_dir / "mps" / "log"
        self.control = control
        self.started = False

    def env(self) -> dict[str, str]:
        """What a replica needs to reach this daemon (nothing when it is not running)."""
        if not self.started:
            return {}
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}
        return subprocess.run([self.control, *args], input=stdin, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)

    def start(self) -> bool:
        """Start the daemon; return whether it runs."""
        if shutil.which(self.control) is None:
            logger.warning("--mps: %s is not installed; running without MPS", self.control)
            return False
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        result = self._run(["-d"])
        if result.returncode != 0:
            logger.warning("--mps: %s -d failed (code %d: %s); running without MPS", self.control,
                           result.returncode, (result.stderr or result.stdout).strip())
            return False
        self.started = True
        logger.info("MPS control daemon started (pipe %s)", self.pipe_dir)
        return True

    def stop(self) -> None:
        """Ask the daemon to quit (it stops its server once the clients are gone)."""
        if not self.started:
            return
        try:
            result = self._run([], stdin="quit\n")
        except subprocess.TimeoutExpired:
            logger.warning("MPS control daemon did not answer `quit` within %g s", TIMEOUT_S)
            return
        if result.returncode != 0:
            logger.warning("MPS quit failed (code %d): %s", result.returncode, result.stderr.strip())
        self.started = False
        logger.info("MPS control daemon stopped")

    def __enter__(self) -> MpsDaemon:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
