"""Reading and writing profiles: a directory of point files (what `planner profile` writes) or a CSV.

Directory: one `point-bNNNNN.json` per batch cap, each `{"schema": 1, "context": {...}, "point": {...}}`, so a
rerun can skip the points already there and a crash loses at most the point being measured.

CSV: the columns of `bca-opt-1.3b-h100-single.csv` (`max_num_seqs` or `batch_size`, `total_tok_s`, and any of
`output_tok_s`, `req_s`, `{mean,p50,p99}_{ttft,tpot,itl,e2e}_ms`, `preemptions`, `peak_kv_usage`); lines starting
with `#` are comments.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from planner.errors import ProfileError
from planner.points import Latency, Profile, ProfileContext, ProfilePoint, Workload

SCHEMA = 1


def point_path(directory: Path, batch_size: int) -> Path:
    return directory / f"point-b{batch_size:05d}.json"


def write_point(directory: Path, context: ProfileContext, point: ProfilePoint) -> Path:
    """Write one point file atomically (a crash never leaves half a file that a rerun would skip)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = point_path(directory, point.batch_size)
    data = {"schema": SCHEMA, "context": context.to_dict(), "point": point.to_dict()}
    fd, scratch = tempfile.mkstemp(prefix=".point-", suffix=".json", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(scratch, target)
    return target


def read_point(path: Path) -> tuple[ProfileContext, ProfilePoint]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"cannot read profile point {str(path)!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile point {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ProfileError(f"profile point {str(path)!r} is not a schema-{SCHEMA} point file")
    try:
        return ProfileContext.from_dict(data.get("context") or {}), ProfilePoint.from_dict(data.get("point") or {})
    except ProfileError as exc:
        raise ProfileError(f"profile point {str(path)!r}: {exc}") from exc


def load_profile(path: str | Path) -> Profile:
    """Read a profile directory or a CSV file."""
    path = Path(path)
    if path.is_dir():
        return _load_directory(path)
    if path.is_file():
        return load_csv(path)
    raise ProfileError(f"profile {str(path)!r} does not exist (give a directory written by `planner profile` "
                       "or a CSV file)")


def _load_directory(directory: Path) -> Profile:
    files = sorted(directory.glob("point-b*.json"))
    if not files:
        raise ProfileError(f"profile directory {str(directory)!r} has no point-b*.json files; "
                           "run `planner profile --out` there first")
    loaded = [read_point(f) for f in files]
    context = loaded[0][0]
    for other, _ in loaded[1:]:
        if (other.model, other.device, other.workload) != (context.model, context.device, context.workload):
            raise ProfileError(f"profile directory {str(directory)!r} mixes runs of different models, devices or "
                               "workloads; give each its own --out directory")
    return Profile(points=tuple(p for _, p in loaded), context=replace(context, source=str(directory)))


def load_csv(path: str | Path) -> Profile:
    """Read a CSV profile in the reference format."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile CSV {str(path)!r}: {exc.strerror}") from exc
    rows = list(csv.DictReader(io.StringIO("\n".join(
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")))))
    if not rows:
        raise ProfileError(f"profile CSV {str(path)!r} has no data rows")
    columns = set(rows[0])
    if "replicas" in columns:
        raise ProfileError(f"{str(path)!r} is a replication table (it has a `replicas` column); "
                           "a profile is one instance swept over batch sizes")
    batch_column = "max_num_seqs" if "max_num_seqs" in columns else "batch_size"
    if batch_column not in columns or "total_tok_s" not in columns:
        raise ProfileError(f"profile CSV {str(path)!r} needs columns `max_num_seqs` (or `batch_size`) and "
                           f"`total_tok_s`; it has {', '.join(sorted(columns))}")
    points = tuple(_csv_point(row, batch_column, path, line) for line, row in enumerate(rows, start=1))
    return Profile(points=points, context=ProfileContext(source=str(path), workload=Workload(kind="unknown")))


def _csv_point(row: dict[str, str], batch_column: str, path: Path, line: int) -> ProfilePoint:
    def number(name: str) -> float | None:
        raw = (row.get(name) or "").strip()
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise ProfileError(f"{str(path)!r} data row {line}: {name} is not a number: {raw!r}") from None
        if not math.isfinite(value):
            raise ProfileError(f"{str(path)!r} data row {line}: {name} is not finite: {raw!r}")
        return value

    batch, total = number(batch_column), number("total_tok_s")
    if batch is None or total is None or batch != int(batch):
        raise ProfileError(f"{str(path)!r} data row {line}: needs an integer {batch_column} and a total_tok_s")
    def latency(name: str) -> Latency:
        return Latency(mean=number(f"mean_{name}_ms"), p50=number(f"p50_{name}_ms"), p99=number(f"p99_{name}_ms"))

    preemptions = number("preemptions")
    try:
        return ProfilePoint(batch_size=int(batch), total_tok_s=total, output_tok_s=number("output_tok_s"),
                            req_s=number("req_s"), preemptions=None if preemptions is None else int(preemptions),
                            peak_kv_usage=number("peak_kv_usage"), ttft_ms=latency("ttft"), tpot_ms=latency("tpot"),
                            itl_ms=latency("itl"), e2e_ms=latency("e2e"))
    except ProfileError as exc:
        raise ProfileError(f"{str(path)!r} data row {line}: {exc}") from exc
