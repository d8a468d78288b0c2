"""The MPS control daemon wrapper, against a FAKE `nvidia-cuda-mps-control` (this machine has no GPU)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

from deploy.mps import MpsDaemon

FAKE_CONTROL = """#!{python}
import json, os, sys
record = {{"args": sys.argv[1:], "stdin": "" if sys.argv[1:] else sys.stdin.read(),
          "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}}
with open({calls!r}, "a") as f:
    f.write(json.dumps(record) + "\\n")
sys.exit({code})
"""


def fake_control(tmp_path: Path, code: int = 0) -> tuple[Path, Path]:
    calls = tmp_path / "calls.jsonl"
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text(FAKE_CONTROL.format(python=sys.executable, calls=str(calls), code=code))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, calls


def test_daemon_starts_private_and_quits(tmp_path: Path) -> None:
    """`-d` starts a daemon with pipe/log dirs inside the run dir; replicas get them; exit sends `quit`."""
    control, calls = fake_control(tmp_path)
    run_dir = tmp_path / "run"
    with MpsDaemon(run_dir, control=str(control)) as mps:
        env = mps.env()
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(run_dir / "mps" / "pipe")
        assert Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [r["args"] for r in records] == [["-d"], []]
    assert records[1]["stdin"].strip() == "quit"
    assert {r["pipe"] for r in records} == {env["CUDA_MPS_PIPE_DIRECTORY"]}
    assert mps.env() == {}


def test_missing_control_binary_means_no_mps(tmp_path: Path) -> None:
    """Asked for MPS where it is not installed: no daemon, no environment, no error."""
    with MpsDaemon(tmp_path, control=str(tmp_path / "absent")) as mps:
        assert not mps.started and mps.env() == {}


def test_failing_daemon_start_means_no_mps(tmp_path: Path) -> None:
    """A daemon that fails to start is reported and not used; nothing is sent to quit it."""
    control, calls = fake_control(tmp_path, code=1)
    with MpsDaemon(tmp_path / "run", control=str(control)) as mps:
        assert mps.env() == {}
    assert len(calls.read_text().splitlines()) == 1
