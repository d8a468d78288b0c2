"""The soak (bench/soak.py), one minute of it (its shortest; `python -m bench.soak` runs ten): the real gateway
over simulated replicas and a fault injector."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_one_minute_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    """Every check of a 1-minute soak passes: one outcome per request, no retry after bytes reached a client,
    counts back to 0 at idle, descriptors and tasks back to their idle level, no restart, every fault injected."""
    report_path = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, "-m", "bench.soak", "--duration", "60", "--seed", "1",
                             "--logs", str(tmp_path / "logs"), "--out", str(report_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert report_path.exists(), result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    failed = [c for c in report["checks"] if not c["ok"]]
    assert result.returncode == 0 and not failed, result.stdout[-4000:]
    assert report["requests"] > 150  # about 5 generation requests/s at 70-110% of capacity for 60 s
    kinds = set(report["outcomes"])
    assert {"json", "stream", "abort", "slow"} <= kinds and any(k.startswith("malformed") for k in kinds)
