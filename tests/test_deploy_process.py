"""Process management: process groups, readiness that fails fast, clean stops (with the FAKE replica)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from deploy.plan import Admission, ReplicaSpec
from deploy.ports import free_ports, port_bound
from deploy.process import (ManagedProcess, ProcessDied, StartupTimeout, VllmServer, group_alive, has_module, tail,
                            vllm_argv, vllm_env)


def fake(port: int, log: Path, **kw: float) -> ManagedProcess:
    argv = [sys.executable, "-m", "tests.fake_replica", "--port", str(port)]
    return ManagedProcess("fake", argv, log, f"http://127.0.0.1:{port}/health", **kw)


def test_context_manager_waits_for_health_and_frees_the_port(tmp_path: Path) -> None:
    """Entering returns once /health is 200; leaving kills the group and frees the port."""
    port = free_ports()
    with fake(port, tmp_path / "fake.log", startup_timeout_s=30) as proc:
        assert proc.healthy()
        pgid = proc.pid
        assert pgid is not None
    assert not group_alive(pgid)
    assert not port_bound(port)


def test_stop_kills_children_in_the_group(tmp_path: Path) -> None:
    """A child the process spawned (like vLLM's engine core) dies with it."""
    script = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)"
    proc = ManagedProcess("parent", [sys.executable, "-c", script], tmp_path / "p.log", "http://127.0.0.1:1/health")
    proc.start()
    time.sleep(0.5)
    assert proc.pid is not None and group_alive(proc.pid)
    proc.stop()
    assert not group_alive(proc.pid)


def test_sigkill_after_grace_when_sigterm_is_ignored(tmp_path: Path) -> None:
    """A process that ignores SIGTERM is killed after the grace period."""
    script = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('READY'+'!', flush=True); time.sleep(60)"
    proc = ManagedProcess("stubborn", [sys.executable, "-c", script], tmp_path / "s.log", "http://127.0.0.1:1/health",
                          stop_grace_s=0.5)
    proc.start()
    deadline = time.monotonic() + 10
    while b"READY!" not in (tmp_path / "s.log").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    proc.stop()
    assert proc.pid is not None and not group_alive(proc.pid)
    assert time.monotonic() - started < 5
    assert proc.poll() == -9


def test_wait_ready_fails_fast_when_the_process_dies(tmp_path: Path) -> None:
    """A process that exits while we wait raises ProcessDied at once, with its log tail."""
    proc = ManagedProcess("doomed", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                          tmp_path / "d.log", "http://127.0.0.1:1/health", startup_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(ProcessDied, match="code 3") as info:
        with proc:
            pass
    assert "boom" in str(info.value)
    assert time.monotonic() - started < 10


def test_wait_ready_times_out(tmp_path: Path) -> None:
    """A process that never gets healthy raises StartupTimeout and is stopped."""
    proc = ManagedProcess("mute", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "m.log",
                          f"http://127.0.0.1:{free_ports()}/health", startup_timeout_s=1.0)
    with pytest.raises(StartupTimeout, match="within 1 s"):
        with proc:
            pass
    assert proc.pid is not None and not group_alive(proc.pid)


def test_vllm_argv_gpu_replica() -> None:
    """A GPU replica gets its model, port, memory fraction, batch cap, context length and extra args."""
    spec = ReplicaSpec(name="r0", model="facebook/opt-125m", port=8001, max_num_seqs=128, max_model_len=2048,
                       gpu_memory_utilization=0.3, extra_args=("--enforce-eager",), admission=Admission(128))
    argv = vllm_argv(spec, python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for part in ("--model facebook/opt-125m", "--port 8001", "--max-num-seqs 128", "--max-model-len 2048",
                 "--gpu-memory-utilization 0.3", "--host 127.0.0.1"):
        assert part in joined
    assert argv[-1] == "--enforce-eager"
    assert "--kv-cache-memory-bytes" not in argv


def test_vllm_argv_kv_bytes_and_served_name() -> None:
    """`kv_cache_memory_bytes` and `served_model_name` become their vLLM flags."""
    spec = ReplicaSpec(name="r1", model="/m/tiny", port=8002, kv_cache_memory_bytes=2_000_000_000,
                       served_model_name="tiny-opt")
    joined = " ".join(vllm_argv(spec))
    assert "--kv-cache-memory-bytes 2000000000" in joined and "--served-model-name tiny-opt" in joined
    assert "--gpu-memory-utilization" not in joined


def test_vllm_env_sets_cpu_kv_cache_in_whole_gib() -> None:
    """The CPU KV cache size goes to VLLM_CPU_KVCACHE_SPACE as whole GiB, at least 1."""
    spec = ReplicaSpec(name="r0", model="m", port=8001, cpu_kvcache_space_gib=0.4)
    assert vllm_env(spec, {"A": "1"}) == {"A": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    spec2 = ReplicaSpec(name="r0", model="m", port=8001, cpu_kvcache_space_gib=2.6)
    assert vllm_env(spec2, {})["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(ReplicaSpec(name="r0", model="m", port=8001), {})


def test_vllm_env_turns_the_flashinfer_sampler_off_only_where_flashinfer_is_missing() -> None:
    """Without flashinfer vLLM 0.26's GPU runner fails at start unless its sampler is told not to use it; a
    value the user set is kept, and with flashinfer nothing is added."""
    spec = ReplicaSpec(name="r0", model="m", port=8001)
    assert vllm_env(spec, {}, flashinfer=False) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert vllm_env(spec, {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, flashinfer=False) == {
        "VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert vllm_env(spec, {}) == {}


def test_only_a_gpu_replica_asks_its_python_for_flashinfer(tmp_path: Path) -> None:
    """A CPU replica's Python is not run at all (a stand-in that sleeps would hold `deploy up` up); a GPU one
    (given a memory share) without flashinfer, as here, gets vLLM's own sampler."""
    sleepy = tmp_path / "python"
    sleepy.write_text("#!/bin/sh\nsleep 30\n")
    sleepy.chmod(0o755)
    started = time.monotonic()
    cpu = VllmServer(ReplicaSpec(name="c", model="m", port=8001, cpu_kvcache_space_gib=1.0), tmp_path / "c.log", {},
                     python=str(sleepy))
    assert time.monotonic() - started < 1.0 and "VLLM_USE_FLASHINFER_SAMPLER" not in cpu.env
    gpu = VllmServer(ReplicaSpec(name="g", model="m", port=8002, gpu_memory_utilization=0.4), tmp_path / "g.log", {})
    expected = None if has_module(sys.executable, "flashinfer") else "0"
    assert gpu.env.get("VLLM_USE_FLASHINFER_SAMPLER") == expected


def test_has_module_asks_the_replicas_own_python(tmp_path: Path) -> None:
    """`has_module` looks in the interpreter given: this one directly, another through a child process."""
    other = tmp_path / "python"
    other.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    other.chmod(0o755)
    for python in (sys.executable, str(other)):
        assert has_module(python, "json") and not has_module(python, "no_such_module_here")
    assert not has_module(str(tmp_path / "missing-python"), "json")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a machine with two or more usable cores to tell confined from free")
def test_a_process_with_cpus_starts_confined_to_them_and_the_starter_is_not(tmp_path: Path) -> None:
    """`cpus`: the process (and what it starts) may run on those cores only, from its first instruction; the
    thread that started it keeps the cores it had."""
    before = os.sched_getaffinity(0)
    core = min(before)
    out = tmp_path / "affinity"
    code = f"import os, pathlib; pathlib.Path({str(out)!r}).write_text(repr(sorted(os.sched_getaffinity(0))))"
    proc = ManagedProcess("p", [sys.executable, "-c", code], tmp_path / "p.log", "http://127.0.0.1:9/health",
                          cpus=[core])
    proc.start()
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() == 0, tail(tmp_path / "p.log")
    assert out.read_text() == repr([core])
    assert os.sched_getaffinity(0) == before


def test_a_process_with_nice_runs_below_normal_priority_as_do_its_children_and_its_session(tmp_path: Path) -> None:
    """`nice`: the process and a child it starts later run that far below normal priority; where the kernel
    groups threads by session (autogroup), the session's group does too; the starter keeps its own."""
    out = tmp_path / "nice"
    child = "import os; print(os.nice(0))"
    code = (f"import os, pathlib, subprocess, sys, time; time.sleep(0.2); "
            f"kid = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout.strip(); "
            f"group = pathlib.Path('/proc/self/autogroup'); "
            f"pathlib.Path({str(out)!r}).write_text(f'{{os.nice(0)}} {{kid}} ' + "
            f"(group.read_text().split()[-1] if group.exists() else 'none'))")
    ours = os.nice(0)
    proc = ManagedProcess("p", [sys.executable, "-c", code], tmp_path / "p.log", "http://127.0.0.1:9/health", nice=7)
    proc.start()
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() == 0, tail(tmp_path / "p.log")
    own, kid, group = out.read_text().split()
    assert (int(own), int(kid)) == (7, 7)
    assert group == "none" or int(group) == 7
    assert os.nice(0) == ours
    with pytest.raises(ValueError, match="0-19"):
        ManagedProcess("p", ["true"], tmp_path / "q.log", "http://127.0.0.1:9/health", nice=20)


def test_a_priority_that_cannot_be_lowered_is_a_warning_not_a_failure(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A read-only /proc (some containers): the process runs at normal priority, and the log says so."""
    from deploy import process

    def refuse(self: Path, text: str) -> int:
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(process.Path, "write_text", refuse)
    monkeypatch.setattr(process.os, "setpriority", lambda which, who, prio: None)
    with caplog.at_level("WARNING", logger="deploy.process"):
        process.lower_priority(os.getpid(), 10)
    assert "could not lower the CPU priority" in caplog.text
