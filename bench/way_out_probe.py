"""The way out of vLLM's API server, measured beside the profiles, for `sim calibrate --way-out`.

vLLM stamps a request's time to first token before its API server has sent the token, and that server streams
every running request's tokens from one event loop: the first token's way out grows with the streams beside it.
`bench.burst_probe --background` shows it as the part of the client's TTFT outside vLLM's own (docs/sim.md, "A
prompt under streaming load"). Here that part is read for a prompt of 128 token ids beside 0..24 streams, on an
idle real replica and on `sim serve` of the plain calibration, the same way; the simulator's way out is the
straight line through their difference (ms, and ms a stream), taken as given by the calibration.

`bench.sim_vs_real --way-out probe` does all of it between the profiles and the runs, as it measures
`bench.prefill_cost`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .burst_probe import SHAPES, measure_loaded
from .common import markdown_table

BACKGROUNDS = (0, 4, 8, 16, 24)  # streams beside the probe
SHAPE = "1 x 128"  # bench.burst_probe's shape probed
REPS = 7  # probes at each count of streams (their medians are read)
WAY_OUT_PROBE = "way_out_probe.json"  # the real replica's readings, in bench.sim_vs_real's folder


@dataclass(frozen=True)
class Outside:
    """A prompt's time outside vLLM's TTFT (the client's TTFT less vLLM's), medians over reps, beside `background`
    streams."""

    background: int
    client_ttft_ms: float
    ttft_ms: float

    @property
    def outside_ms(self) -> float:
        return self.client_ttft_ms - self.ttft_ms


@dataclass(frozen=True)
class WayOut:
    """A streamed chunk's way out: `ms` + `ms_per_stream` x the other streams (`ReplicaModel.way_out_s`, ...)."""

    ms: float
    ms_per_stream: float

    @property
    def flag(self) -> str:
        """As `sim calibrate --way-out` takes it."""
        return f"{self.ms:.3f},{self.ms_per_stream:.4f}"


def probe_outside(url: str, backgrounds: Sequence[int] = BACKGROUNDS, reps: int = REPS, seed: int = 0,
                  window_s: float = 0.5) -> list[Outside]:
    """`SHAPE` beside each count of `backgrounds` streams on the replica at `url` (idle but for them); `window_s`:
    `bench.burst_probe`'s reading of the steps before each count's probes (not kept here)."""
    return [Outside(x.background, x.readings[0].client_ttft_ms, x.readings[0].ttft_ms)
            for x in measure_loaded(url, backgrounds, reps, seed, window_s, shapes=(SHAPE,))]


def fit_way_out(real: Sequence[Outside], sim: Sequence[Outside]) -> WayOut:
    """The least-squares line through real less simulated time outside, by the streams beside the probe, neither
    coefficient below 0 (a way out is a delay). Both sides must have probed the same counts."""
    real_at = {r.background: r.outside_ms for r in real}
    sim_at = {r.background: r.outside_ms for r in sim}
    if sorted(real_at) != sorted(sim_at) or len(real_at) < 2:
        raise ValueError(f"the way out needs the same two or more stream counts on both sides, got "
                         f"{sorted(real_at)} real and {sorted(sim_at)} simulated")
    n = np.array(sorted(real_at), dtype=float)
    gap = np.array([real_at[k] - sim_at[k] for k in sorted(real_at)])
    slope, base = np.polyfit(n, gap, 1)
    if slope < 0:
        slope, base = 0.0, float(np.mean(gap))
    if base < 0:
        base, slope = 0.0, max(0.0, float(n @ gap / (n @ n))) if n @ n else 0.0
    return WayOut(max(0.0, float(base)), float(slope))


def save(path: Path, readings: Sequence[Outside]) -> None:
    path.write_text(json.dumps([asdict(r) for r in readings], indent=1) + "\n")


def load(path: Path) -> list[Outside]:
    return [Outside(**r) for r in json.loads(path.read_text())]


def record(real: Sequence[Outside], plain: Sequence[Outside], fit: WayOut) -> dict[str, Any]:
    """What bench.sim_vs_real keeps in its meta: both sides' readings and the fit."""
    return {"real": [asdict(r) for r in real], "plain": [asdict(r) for r in plain], "fit": asdict(fit)}


def lines(probed: dict[str, Any] | None, modelled: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """The report's section (none where `probed` is None): outside vLLM's TTFT by streams, real, the plain
    calibration and (where `modelled`) the model with the fitted way out, and the fit; `probed` as `record` wrote it."""
    if not probed:
        return []
    real, plain = ([Outside(**r) for r in probed[side]] for side in ("real", "plain"))
    model = {r.background: r for r in (Outside(**m) for m in modelled or [])}
    fit = probed["fit"]

    def out(r: Outside | None) -> str:
        return f"{r.outside_ms:.1f}" if r else ""

    body = [[r.background, f"{r.client_ttft_ms:.1f}", out(r), out(p), out(model.get(r.background))]
            for r, p in zip(real, plain)]
    return ["## The way out of the API server, probed beside the profiles (`--way-out probe`)", "",
            f"A prompt of {SHAPES[SHAPE][0]} token ids beside N streams (`bench.burst_probe --background`), on "
            "the idle first real replica after the profiles and on `sim serve` of the plain calibration, the same "
            f"way; medians of {REPS} reps, in ms. Outside: the client's TTFT less vLLM's own. The simulator's way "
            f"out is the line through real less plain: **{fit['ms']:.2f} ms + {fit['ms_per_stream']:.3f} ms a "
            "stream**, taken as given by the calibration"
            + (" (the last column: `sim serve` of the model with it, probed the same way)." if model else "."), "",
            markdown_table(["streams", "real client TTFT", "outside, real", "plain model", "with the way out"],
                           body), ""]
