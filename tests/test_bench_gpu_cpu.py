"""bench.gpu.cpu: cores used per process tree, the process itself apart from its children."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.gpu.cpu import CpuMeter, tree_cpu_seconds

SPIN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\ntime.sleep(30)"
PARENT = ("import subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-c', {child!r}])\n"
          "time.sleep(30)")


def test_a_busy_child_counts_for_its_tree_and_not_for_its_idle_parent() -> None:
    """A parent that sleeps and its child that spins 1 s of CPU: the child's second shows under the tree only."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(child=SPIN.format(s=1.0))])
    try:
        meter = CpuMeter({"api server": [(parent.pid, False)], "engine": [(parent.pid, True)], "none": []})
        meter.start()
        time.sleep(2.0)
        used = meter.stop()
        assert set(used) == {"api server", "engine"}  # a group with no process is left out
        assert used["api server"] < 0.1
        assert 0.3 < used["engine"] <= 0.75  # about 1 s of CPU in about 2 s (less if it started before start())
    finally:
        parent.kill()
        parent.wait()
    assert tree_cpu_seconds(parent.pid, False) == 0.0  # gone: no time, no error
