"""The gateway, load tests, deploy and the planner type-check under mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deploy.tinymodel import default_cache_dir

ROOT = Path(__file__).resolve().parent.parent


def test_packages_are_mypy_strict_clean() -> None:
    """mypy --strict finds nothing in gateway/, loadtest/, deploy/, planner/, synthetic/ and bench/gpu.

    Its cache lives beside the tiny model (smallserve's cache), not in the checkout: CI's clean checkout then
    checks incrementally, about 1 s instead of 32 here. mypy takes a cached module as fresh only where its
    source's hash, mypy's version and the options match the cache's, so a change is always checked."""
    cache = default_cache_dir() / "mypy"
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), "gateway", "loadtest", "deploy",
                             "planner", "synthetic", "bench/gpu", "bench/gpu_replication.py"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
