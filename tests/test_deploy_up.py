"""`deploy up`'s orchestration, fast: FAKE vLLM replicas (tests/fake_replica.py) behind the real gateway.

A stand-in interpreter runs the fake wherever `deploy up` would start vLLM's API server, so the start (all at
once on CPU, one after another on a GPU), the state file, supervision and the clean stop are exercised in
seconds; test_deploy_vllm.py does it for real.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from deploy import state as run_state
from deploy.hardware import Gpu, Hardware
from deploy.launch import PlanOptions, default_plan, launches
from deploy.ports import free_ports
from deploy.process import StopFlag, group_alive
from deploy.supervisor import Backoff
from deploy.up import DeployError, UpConfig, run

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = """#!{python}
import os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
    port = args[args.index("--port") + 1]
    name = args[args.index("--served-model-name") + 1]
    os.execv({python!r}, [{python!r}, "-m", "tests.fake_replica", "--port", port, "--model", name])
os.execv({python!r}, [{python!r}, *args])
"""


@pytest.fixture
def config(tmp_path: Path) -> UpConfig:
    python = tmp_path / "python"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    hardware = Hardware(gpus=(), cpus=(0, 1))
    base = free_ports(3)
    plan = default_plan(PlanOptions(model="fake-model", replicas=2, port=base), hardware)
    plan = replace(plan, replicas=tuple(replace(r, served_model_name="fake-model") for r in plan.replicas))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return UpConfig(plan=plan, launches=tuple(launches(plan, hardware)), hardware=hardware, run_dir=tmp_path / "run",
                    model_label="fake-model", host="127.0.0.1", startup_timeout_s=30, stop_grace_s=3,
                    backoff=Backoff(initial_s=0.2, max_s=1), base_env=env, python=str(python))


def wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def healthy(run_dir: Path) -> bool:
    try:
        state = run_state.read(run_dir)
    except run_state.StateError:
        return False
    procs = [state.gateway, *state.replicas] if state.gateway else []
    return bool(procs) and all(p.healthy and p.status == "running" for p in procs)


def test_up_supervises_and_stops_everything(config: UpConfig) -> None:
    """Replicas then gateway come up; a killed replica is restarted; stopping leaves no process group behind."""
    stop = StopFlag()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run(config, stop)
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        wait(lambda: healthy(config.run_dir), 30, "a healthy deployment")
        state = run_state.read(config.run_dir)
        assert [r.url for r in state.replicas] == [f"http://127.0.0.1:{r.port}" for r in config.plan.replicas]
        assert state.gateway is not None and Path(state.gateway.log).is_file()
        assert all(Path(r.log).is_file() for r in state.replicas)
        gateway_config = yaml.safe_load((config.run_dir / "gateway.yaml").read_text())
        assert [r["max_requests"] for r in gateway_config["replicas"]] == [32, 32]
        body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(f"{state.gateway.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(request, timeout=10).status == 200

        victim = state.replicas[0]
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)
        wait(lambda: run_state.read(config.run_dir).replicas[0].restarts == 1 and healthy(config.run_dir), 30,
             "the killed replica to be restarted")
        pids = [p.pid for p in (run_state.read(config.run_dir).gateway, *run_state.read(config.run_dir).replicas)
                if p and p.pid]
        assert victim.pid not in pids and len(pids) == 3
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and not errors
    assert not any(group_alive(pid) for pid in pids)
    final = run_state.read(config.run_dir)
    assert final.stopped and not run_state.is_running(final)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_replicas_start_at_once_on_cpu_and_one_after_another_on_a_gpu(config: UpConfig, tmp_path: Path,
                                                                       device: str) -> None:
    """Each replica takes 1 s to come up: on CPU the second starts with the first (their memory is set, and each
    has its own cores); on a GPU only once the first is healthy (vLLM sizes its memory from what is free)."""
    starts = tmp_path / "starts"
    python = tmp_path / "slow-python"
    python.write_text(STAND_IN.format(python=sys.executable).replace(
        "args = sys.argv[1:]\n", f"args = sys.argv[1:]\nimport time\nif 'vllm' in ' '.join(args):\n"
        f"    open({str(starts)!r}, 'a').write(f'{{time.time()}}\\n')\n    time.sleep(1.0)\n", 1))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    hardware = Hardware(gpus=(Gpu(0, "pretend", 80 << 30),), cpus=(0, 1)) if device == "gpu" else config.hardware
    stop = StopFlag()
    thread = threading.Thread(target=run, args=(replace(config, python=str(python), hardware=hardware), stop))
    thread.start()
    try:
        wait(lambda: healthy(config.run_dir), 30, "a healthy deployment")
    finally:
        stop.set()
        thread.join(30)
    first, second = sorted(float(t) for t in starts.read_text().split())
    assert (second - first < 0.9) if device == "cpu" else (second - first > 1.0), second - first


def test_replica_that_dies_at_start_fails_the_deployment_fast(config: UpConfig, tmp_path: Path) -> None:
    """A replica that exits before it is healthy ends `deploy up` with its log tail, nothing left running."""
    broken = tmp_path / "broken-python"
    broken.write_text(f"#!{sys.executable}\nimport sys\nprint('CUDA out of memory (pretend)')\nsys.exit(1)\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    started = time.monotonic()
    with pytest.raises(DeployError, match="out of memory"):
        run(replace(config, python=str(broken)), StopFlag())
    assert time.monotonic() - started < 15
    assert run_state.read(config.run_dir).stopped


def test_port_in_use_is_refused_before_anything_starts(config: UpConfig) -> None:
    """A replica port already taken is an error naming the port; no process is started."""
    port = config.plan.replicas[1].port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(DeployError, match=str(port)):
            run(config, StopFlag())
    assert not (config.run_dir / "logs").exists()


def test_second_deployment_on_the_same_run_dir_is_refused(config: UpConfig) -> None:
    """A run directory whose deployment still runs cannot be reused."""
    run_state.write(config.run_dir, run_state.RunState(pid=os.getppid(), started_at=0.0, device="cpu", model="m",
                                                       gateway=None, replicas=()))
    with pytest.raises(DeployError, match="already runs"):
        run(config, StopFlag())


def test_stop_during_startup_stops_the_starting_replica(config: UpConfig, tmp_path: Path) -> None:
    """Ctrl-C/SIGTERM while a replica is still loading: `deploy up` returns promptly and kills its group."""
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
    slow.chmod(slow.stat().st_mode | stat.S_IXUSR)
    stop = StopFlag()
    thread = threading.Thread(target=run, args=(replace(config, python=str(slow)), stop))
    thread.start()
    wait(lambda: (config.run_dir / "state.json").exists(), 10, "the first replica to start")
    pid = run_state.read(config.run_dir).replicas[0].pid
    assert pid is not None and group_alive(pid)
    stopped = time.monotonic()
    stop.set()
    thread.join(15)
    assert not thread.is_alive() and time.monotonic() - stopped < 10
    assert not group_alive(pid)
    assert run_state.read(config.run_dir).stopped
