"""The gateway, load tests and deploy type-check under mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_packages_are_mypy_strict_clean() -> None:
    """mypy --strict finds nothing in gateway/, loadtest/ and deploy/."""
    result = subprocess.run([sys.executable, "-m", "mypy", "gateway", "loadtest", "deploy"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
