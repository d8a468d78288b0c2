"""The run state file, `deploy status`, and model resolution (hub, cache, local path, tiny fallback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import state as run_state
from deploy.models import HubAnswer, ModelError, resolve
from deploy.state import ProcessState, RunState


def sample(pid: int, stopped: bool = False) -> RunState:
    gateway = ProcessState("gateway", "http://127.0.0.1:8000", 11, True, 0, "/run/logs/gateway.log", "running")
    replicas = (ProcessState("r0", "http://127.0.0.1:8001", 12, True, 0, "/run/logs/r0.log", "running"),
                ProcessState("r1", "http://127.0.0.1:8002", None, False, 3, "/run/logs/r1.log", "backoff"))
    return RunState(pid=pid, started_at=1.0, device="cpu", model="tiny-opt", gateway=gateway, replicas=replicas,
                    stopped=stopped)


def test_state_round_trips(tmp_path: Path) -> None:
    """What the supervisor writes is what status reads, and no temporary file is left."""
    state = sample(os.getpid())
    run_state.write(tmp_path, state)
    assert run_state.read(tmp_path) == state
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_missing_state_names_the_directory(tmp_path: Path) -> None:
    """Reading a run directory with no state says which directory."""
    with pytest.raises(run_state.StateError, match=str(tmp_path)):
        run_state.read(tmp_path)


def test_corrupt_state_is_an_error(tmp_path: Path) -> None:
    """A state file that is not ours is reported, not a traceback."""
    (tmp_path / "state.json").write_text('{"pid": 1}')
    with pytest.raises(run_state.StateError, match="not a deployment state"):
        run_state.read(tmp_path)


def test_is_running_needs_a_live_pid_and_no_stop_mark() -> None:
    """A state is live only while its `deploy up` process exists and has not marked it stopped."""
    assert run_state.is_running(sample(os.getpid()))
    assert not run_state.is_running(sample(os.getpid(), stopped=True))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not run_state.is_running(sample(int(dead.stdout)))


def test_status_cli_json_and_table(tmp_path: Path) -> None:
    """`deploy status --json` prints the state with `running`; the table lists every process and its log."""
    run_state.write(tmp_path, sample(os.getpid()))
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--json", "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["running"] is True and data["gateway"]["url"] == "http://127.0.0.1:8000"
    assert [(r["name"], r["restarts"], r["healthy"]) for r in data["replicas"]] == [("r0", 0, True), ("r1", 3, False)]
    table = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--run-dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=60).stdout
    assert "/run/logs/r1.log" in table and "backoff" in table and "gateway" in table


def test_status_cli_without_deployment_fails_cleanly(tmp_path: Path) -> None:
    """No state: exit code 2, one line on stderr, no traceback."""
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no deployment state" in out.stderr and "Traceback" not in out.stderr


def fake_tiny(tmp_path: Path) -> Path:
    """A directory that passes for a made tiny model (so tests do not import torch)."""
    path = tmp_path / "tiny"
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (path / name).write_text("{}")
    return path


def test_unreachable_hub_falls_back_to_the_tiny_model(tmp_path: Path) -> None:
    """No network and no cached copy: the tiny model stands in, and the reason is given."""
    tiny = fake_tiny(tmp_path)
    got = resolve("facebook/opt-125m", tiny_dir=tiny, hub=lambda m, t: HubAnswer(False, False, "no DNS"),
                  cached=lambda m: False)
    assert got.source == str(tiny) and got.served_name == "tiny-opt"
    assert got.fallback_reason is not None and "no DNS" in got.fallback_reason


def test_cached_model_is_used_offline(tmp_path: Path) -> None:
    """No network but a cached copy: the cached model, with the hub marked offline."""
    got = resolve("facebook/opt-125m", tiny_dir=fake_tiny(tmp_path), hub=lambda m, t: HubAnswer(False, False, "x"),
                  cached=lambda m: True)
    assert got.source == "facebook/opt-125m" and got.offline and got.fallback_reason is None


def test_reachable_hub_and_known_model_passes_through(tmp_path: Path) -> None:
    """A model the hub knows is loaded by id."""
    got = resolve("facebook/opt-125m", hub=lambda m, t: HubAnswer(True, True), cached=lambda m: False)
    assert got.source == "facebook/opt-125m" and got.served_name is None and not got.offline


def test_unknown_hub_model_is_an_error() -> None:
    """A reachable hub that does not know the id: a clear error, no silent fallback."""
    with pytest.raises(ModelError, match="no-such/model"):
        resolve("no-such/model", hub=lambda m, t: HubAnswer(True, False, "no such model"), cached=lambda m: False)


def test_local_paths(tmp_path: Path) -> None:
    """A model directory is used as is; a path with no model there is an error naming it."""
    (tmp_path / "config.json").write_text("{}")
    got = resolve(str(tmp_path), hub=lambda m, t: pytest.fail("no hub for paths"))
    assert got.source == str(tmp_path.resolve())
    with pytest.raises(ModelError, match="nowhere"):
        resolve(str(tmp_path / "nowhere"), hub=lambda m, t: pytest.fail("no hub for paths"))


def test_tiny_alias(tmp_path: Path) -> None:
    """`--model tiny` asks for the tiny model directly, with no fallback message."""
    got = resolve("tiny", tiny_dir=fake_tiny(tmp_path))
    assert got.served_name == "tiny-opt" and got.fallback_reason is None
