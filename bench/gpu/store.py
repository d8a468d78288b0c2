"""Where the benchmark keeps what it measured: one JSON file per point, written atomically, never re-measured."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


class Store:
    """`OUT/points/<step>/<name>.json`, and `OUT/timings.json` (each step's wall time, per run)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def path(self, step: str, name: str) -> Path:
        return self.out / "points" / step / f"{name}.json"

    def get(self, step: str, name: str) -> dict[str, Any] | None:
        path = self.path(step, name)
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        assert isinstance(data, dict)
        return data

    def has(self, step: str, name: str) -> bool:
        return self.path(step, name).is_file()

    def put(self, step: str, name: str, data: dict[str, Any]) -> Path:
        return write_json(self.path(step, name), data)

    def all(self, step: str) -> dict[str, dict[str, Any]]:
        """Every point of a step, by name."""
        folder = self.out / "points" / step
        return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}

    def add_time(self, step: str, seconds: float, note: str = "") -> None:
        path = self.out / "timings.json"
        rows = json.loads(path.read_text()) if path.is_file() else []
        rows.append({"step": step, "seconds": round(seconds, 1), "note": note,
                     "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
        write_json(path, rows)

    def timings(self) -> list[dict[str, Any]]:
        path = self.out / "timings.json"
        data = json.loads(path.read_text()) if path.is_file() else []
        assert isinstance(data, list)
        return data


def write_json(path: Path, data: Any) -> Path:
    """Write JSON atomically: a crash never leaves half a file that a rerun would take as measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(scratch, path)
    return path
