"""TPOT against how many requests each replica held, run by run, real and simulated: is the gap the step time at a
given batch, or the batch the step time leads to?

A run's mean number of requests in flight per replica follows from Little's law: its arrival rate times its mean
end-to-end latency, over the replicas. Slower steps keep requests longer, which fills the batch, which slows the
steps: a small gap in step time grows into a large one in TPOT. Set side by side at the same in-flight count, the
two sides show how much of the gap is the step itself. Below the table, for the real side: how TPOT ranks with the
CPU the rest of the machine took (gateways, the load generator, the system: `cpu.rest` of each run) and, where the
run recorded it, with the machine's speedometer (`bench.common.machine_speed`): the same work of the gateways and
the load generator takes more CPU on a slower machine, so "rest" alone cannot tell cause from symptom.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import markdown_table
from .sim_vs_real_steps import rank_correlation

BINS = (0.0, 3.0, 5.0, 7.0, 10.0, 15.0, 25.0, float("inf"))


def inflight(row: dict[str, Any], replicas: int) -> float:
    """Mean requests in flight per replica over the run (Little's law)."""
    return float(row["rate"] * np.mean(row["e2e_s"]) / replicas) if row["e2e_s"] else float("nan")


def _bin(value: float) -> str:
    for lo, hi in zip(BINS, BINS[1:]):
        if lo <= value < hi:
            return f"{lo:g}-{hi:g}" if hi != float("inf") else f"{lo:g}+"
    return "?"


def inflight_lines(rows: Sequence[dict[str, Any]], replicas: int, sim_side: str) -> list[str]:
    """The report's section: per in-flight bin, each side's runs and median TPOT; the real runs' TPOT against the
    rest of the machine's CPU within each load."""
    single = [r for r in rows if r["workload"] != "chat" and r["tpot_s"] and r["side"] in ("real", sim_side)]
    if not any(r["side"] == "real" for r in single) or not any(r["side"] == sim_side for r in single):
        return []
    cells: dict[tuple[str, str], list[float]] = {}
    for r in single:
        cells.setdefault((_bin(inflight(r, replicas)), r["side"]), []).append(1000 * float(np.median(r["tpot_s"])))
    labels = [_bin(lo) for lo in BINS[:-1]]
    body = []
    for label in labels:
        real, sim = cells.get((label, "real"), []), cells.get((label, sim_side), [])
        if real or sim:
            body.append([label, len(real), f"{np.median(real):.1f}" if real else "-", len(sim),
                         f"{np.median(sim):.1f}" if sim else "-",
                         f"{np.median(sim) / np.median(real) - 1:+.0%}" if real and sim else "-"])
    lines = [f"## TPOT at the same requests in flight (`{sim_side}`)", "",
             "Each run's mean requests in flight per replica (Little's law: rate x mean E2E / replicas), binned; per "
             "bin the runs of each side and the median of their TPOT p50 (ms).", "",
             markdown_table(["in flight per replica", "real runs", "real TPOT", "sim runs", "sim TPOT",
                             "sim / real - 1"], body), ""]
    by_load: dict[float, list[tuple[float, float, float, float]]] = {}
    for r in single:
        if r["side"] == "real" and r.get("cpu"):
            by_load.setdefault(r["load"], []).append((r["cpu"]["rest"], 1000 * float(np.median(r["tpot_s"])),
                                                      inflight(r, replicas), r.get("speed_us", math.nan)))
    notes = []
    for load, points in sorted(by_load.items()):
        if len(points) >= 3:
            rest, tpot, held, speed = (np.array(v) for v in zip(*points))
            note = (f"{load:g}: rest {rest.min():.2f}-{rest.max():.2f} cores, TPOT {tpot.min():.1f}-{tpot.max():.1f} "
                    f"ms, in flight {held.min():.1f}-{held.max():.1f}, rank correlation of TPOT with rest "
                    f"{rank_correlation(rest, tpot):+.2f}")
            if not np.isnan(speed).any():
                note += (f", with the speedometer (us of CPU for a fixed piece of work, about each run) "
                         f"{speed.min():.0f}-{speed.max():.0f} us {rank_correlation(speed, tpot):+.2f}")
            notes.append(note + f" ({len(points)} runs)")
    if notes:
        lines += ["Real runs by load, the rest of the machine's CPU against TPOT: " + "; ".join(notes) + ".", ""]
    return lines + series_lines(rows, replicas)


def series_lines(rows: Sequence[dict[str, Any]], replicas: int) -> list[str]:
    """The real side's runs in the order they ran, with the speedometer: a slow phase of the machine shows as a
    stretch of slow runs whatever their point and policy."""
    real = [r for r in rows if r["side"] in ("real", "real-repeat") and r["workload"] != "chat" and r["tpot_s"]]
    if not real or not all("speed_us" in r for r in real):
        return []
    body = [[i, f"{r['workload']}/{r['load']:g}/{r['seed']}",
             r["policy"] + (" (repeat)" if r["side"] != "real" else ""),
             f"{r['speed_us'] / 1000:.1f}", f"{r['cpu']['rest']:.2f}" if r.get("cpu") else "-",
             f"{inflight(r, replicas):.1f}", f"{1000 * float(np.median(r['tpot_s'])):.1f}"]
            for i, r in enumerate(real, start=1)]
    return ["### The real series in the order it ran", "",
            "Speedometer: ms of CPU for one fixed piece of Python work, the median of 3 before and 3 after the run "
            "(more: a slower machine).", "",
            markdown_table(["#", "point / seed", "policy", "speedometer ms", "rest (cores)", "in flight per replica",
                            "TPOT p50 ms"], body), ""]

