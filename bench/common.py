"""Small helpers the benchmarks share: where results go, Markdown tables, matplotlib set up headless, and a speedometer
for the machine."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench"
FIGURES = ROOT / "docs" / "figures"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, data: object, table: str) -> None:
    """Write `docs/bench/<name>.json` and `docs/bench/<name>.md`."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(table + "\n")


def figure_path(name: str) -> Path:
    FIGURES.mkdir(parents=True, exist_ok=True)
    return FIGURES / name


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """This repository at git revision `rev`, checked out in a temporary worktree (removed afterwards): run an
    older gateway beside the current one (with PYTHONPATH set to the tree) for an A/B in one run."""
    tree = Path(tempfile.mkdtemp(prefix="baseline-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                   capture_output=True, timeout=60)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, timeout=60, check=False,
                       capture_output=True)
        shutil.rmtree(tree.parent, ignore_errors=True)


def machine_speed(work: int = 200_000) -> float:
    """CPU microseconds this process's thread spends on a fixed piece of Python work (a speedometer for the machine:
    it rises when the core is slower or shared at the hardware level, not when the thread merely waits its turn).
    About 20 ms on this 2-core VM."""
    start = time.thread_time()
    total = 0
    for i in range(work):
        total += i * i % 7
    return (time.thread_time() - start) * 1e6 if total >= 0 else math.nan
