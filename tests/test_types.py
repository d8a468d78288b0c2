"""The gateway, load tests, deploy and the planner type-check under mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_packages_are_mypy_strict_clean() -> None:
    """mypy --strict finds nothing in gateway/, loadtest/, deploy/, planner/, synthetic/ and bench/gpu."""
    result = subprocess.run([sys.executable, "-m", "mypy", "gateway", "loadtest", "deploy", "planner", "synthetic", "bench/gpu", "bench/gpu_replication.py"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
