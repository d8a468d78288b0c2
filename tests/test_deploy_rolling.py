"""`deploy restart --rolling`, fast: `deploy up` over FAKE replicas (test_deploy_vllm.py does it on real vLLM)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from deploy import state as run_state
from deploy.process import StopFlag
from deploy.rolling import RollingConfig, RollingError, rolling_restart
from deploy.up import UpConfig, run
from tests.test_deploy_up import ROOT, STAND_IN, config, healthy, wait  # noqa: F401  (config: fixture)

MODEL = "fake-model"


class Load:
    """Clients sending requests (streamed and not) in threads until stopped; every failure is kept."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": i % 2 == 1}).encode()
            request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    text = response.read()
                    if response.status != 200 or (i % 2 and not text.endswith(b"data: [DONE]\n\n")):
                        self.failures.append(f"{response.status} {text[-200:]!r}")
                        continue
                    self.ok += 1
            except (urllib.error.URLError, OSError) as exc:
                self.failures.append(repr(exc))


@pytest.fixture
def slow_config(config: UpConfig, tmp_path: Path) -> UpConfig:  # noqa: F811
    """The fake replicas stream a token every 10 ms, so requests are in flight whenever a drain starts."""
    python = tmp_path / "python-slow"
    python.write_text(STAND_IN.format(python=sys.executable).replace('"--model", name]', '"--model", name, "--itl", '
                                                                                          '"0.01"]'))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return replace(config, python=str(python))


def test_rolling_restart_under_load_fails_no_request(slow_config: UpConfig) -> None:
    """Each replica is drained, restarted and taken back in turn while clients keep sending: not one fails. Then
    `--replica r1` restarts that one alone; a name the deployment does not have is refused, naming those it has."""
    stop = StopFlag()
    thread = threading.Thread(target=run, args=(slow_config, stop))
    thread.start()
    run_dir = slow_config.run_dir
    try:
        wait(lambda: healthy(run_dir), 30, "a healthy deployment")
        before = run_state.read(run_dir)
        assert before.gateway is not None
        for secret in (run_dir / "admin.key", run_dir / "gateway.yaml"):
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        lines: list[str] = []
        with Load(before.gateway.url) as load:
            wait(lambda: load.ok > 20, 10, "the load to start")
            rolling_restart(RollingConfig(run_dir, poll_s=0.1), lines.append)
            served = load.ok
            wait(lambda: load.ok > served + 20, 10, "requests after the restart")
        after = run_state.read(run_dir)
        assert load.failures == [] and load.ok > 50
        assert [r.restarts for r in after.replicas] == [1, 1]
        assert all(a.pid != b.pid for a, b in zip(after.replicas, before.replicas))
        assert after.gateway is not None and after.gateway.pid == before.gateway.pid  # the gateway kept running
        assert sum("draining" in line for line in lines) == 2
        rolling_restart(RollingConfig(run_dir, poll_s=0.1, only=("r1",)), lines.append)
        again = run_state.read(run_dir)
        assert [r.restarts for r in again.replicas] == [1, 2] and again.replicas[0].pid == after.replicas[0].pid
        with pytest.raises(RollingError, match=r"no replica named r9 .*r0, r1"):
            rolling_restart(RollingConfig(run_dir, only=("r9",)))
    finally:
        stop.set()
        thread.join(30)


def test_rolling_restart_needs_a_running_deployment(tmp_path: Path) -> None:
    """No deployment in the run directory: a one-line error from the command, exit status 2."""
    with pytest.raises(run_state.StateError):
        rolling_restart(RollingConfig(tmp_path))
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "restart", "--rolling", "--run-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no deployment state" in result.stderr and "Traceback" not in result.stderr
