"""Every module of every package imports: a module no test runs (a benchmark, say) still cannot rot unseen.

bench.multi_gateway imported a helper that a refactoring had removed, and nothing noticed. Run in a subprocess:
some modules import locust, which must stay out of the pytest process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "deploy", "gateway", "loadtest", "planner", "sim", "synthetic")

SCRIPT = """
import importlib, json, pkgutil, sys
failed, count = {}, 0
for package in sys.argv[1:]:
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        count += 1
        try:
            importlib.import_module(info.name)
        except Exception as error:  # reported, not swallowed: the test fails on it
            failed[info.name] = repr(error)
print(json.dumps({"count": count, "failed": failed}))
"""


def test_every_module_imports() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT, *PACKAGES], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}
    assert report["count"] > 100
