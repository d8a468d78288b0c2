"""Open-loop arrival schedules: seeded, pure functions returning send times in seconds from the start.

Every process here is a renewal process with gamma-distributed gaps (shape k, the burstiness; k=1 is
Poisson, k<1 burstier, CV of the gaps = 1/sqrt(k), as in `vllm bench serve`) run on a warped clock: the
gaps are drawn at unit rate and mapped through the inverse of the cumulative rate Λ(t), so a rate that
changes over time (steps, ramps) keeps the same burstiness at every rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "gamma", "burst", "step", "ramp")


@dataclass(frozen=True)
class ArrivalSpec:
    """Which arrival process to draw, and its parameters."""

    kind: str = "poisson"
    rate: float = 1.0  # requests/s; the base rate under bursts
    duration: float = 60.0  # seconds of schedule
    burstiness: float = 1.0  # gamma shape k
    burst_size: int = 10
    burst_period: float = 10.0
    steps: tuple[tuple[float, float], ...] = ()  # (time s, rate req/s) for step and ramp
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"arrival {self.kind!r} is not one of {', '.join(ARRIVALS)}")
        if not self.duration > 0:
            raise ValueError(f"duration {self.duration!r} must be > 0 seconds")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness {self.burstiness!r} must be > 0")
        if self.seed < 0:
            raise ValueError(f"seed {self.seed!r} must be >= 0")
        if self.kind == "poisson" and self.burstiness != 1.0:
            raise ValueError(f"burstiness {self.burstiness!r} needs --arrival gamma (poisson is burstiness 1)")
        if self.kind in ("poisson", "gamma") and not self.rate > 0:
            raise ValueError(f"rate {self.rate!r} must be > 0 requests/s")
        if self.kind == "burst":
            _check_burst(self.rate, self.burst_size, self.burst_period)
        if self.kind in ("step", "ramp"):
            _check_points(self.steps)


def _check_burst(base_rate: float, burst_size: int, period: float) -> None:
    if not base_rate >= 0:
        raise ValueError(f"base rate {base_rate!r} must be >= 0 requests/s")
    if burst_size < 1:
        raise ValueError(f"burst size {burst_size!r} must be >= 1")
    if not period > 0:
        raise ValueError(f"burst period {period!r} must be > 0 seconds")


def _check_points(points: Sequence[tuple[float, float]]) -> None:
    if not points:
        raise ValueError("steps are empty: give time:rate pairs such as 0:5,30:10")
    if points[0][0] != 0:
        raise ValueError(f"steps must start at time 0, not {points[0][0]!r}")
    times = [t for t, _ in points]
    if any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError(f"step times {times!r} must increase")
    if any(not r >= 0 for _, r in points) or not any(r > 0 for _, r in points):
        raise ValueError(f"step rates {[r for _, r in points]!r} must be >= 0 with one > 0")


def poisson(rate: float, duration: float, seed: int = 0) -> np.ndarray:
    """Send times of a Poisson process at `rate` per second over `duration` seconds."""
    return gamma(rate, 1.0, duration, seed)


def gamma(rate: float, burstiness: float, duration: float, seed: int = 0) -> np.ndarray:
    """Send times with gamma gaps of mean 1/rate and shape `burstiness` (CV 1/sqrt(k))."""
    return step([(0.0, rate)], duration, seed, burstiness)


def step(points: Sequence[tuple[float, float]], duration: float, seed: int = 0,
         burstiness: float = 1.0) -> np.ndarray:
    """Send times whose rate is `rate_i` from `time_i` until the next point (the last until the end)."""
    return _warp(_Profile.of(points, duration, linear=False), burstiness, seed)


def ramp(points: Sequence[tuple[float, float]], duration: float, seed: int = 0,
         burstiness: float = 1.0) -> np.ndarray:
    """Send times whose rate moves linearly between the (time, rate) points, flat after the last."""
    return _warp(_Profile.of(points, duration, linear=True), burstiness, seed)


def burst_times(period: float, duration: float) -> np.ndarray:
    """The burst instants: every `period` seconds from `period` on, so a full period precedes the first."""
    return np.arange(1, math.ceil(duration / period)) * period


def burst(base_rate: float, burst_size: int, period: float, duration: float, seed: int = 0,
          burstiness: float = 1.0) -> np.ndarray:
    """A base process at `base_rate` plus `burst_size` requests at once at each burst instant."""
    _check_burst(base_rate, burst_size, period)
    base = gamma(base_rate, burstiness, duration, seed) if base_rate > 0 else np.empty(0)
    spikes = np.repeat(burst_times(period, duration), burst_size)
    return np.sort(np.concatenate([base, spikes]), kind="stable")


@dataclass(frozen=True)
class _Profile:
    """A piecewise-linear rate: segment j starts at `starts[j]` with rate `rates[j]` and slope `slopes[j]`."""

    starts: np.ndarray
    rates: np.ndarray
    slopes: np.ndarray
    cumulative: np.ndarray  # Λ at each segment start
    total: float  # Λ(duration)

    @classmethod
    def of(cls, points: Sequence[tuple[float, float]], duration: float, linear: bool) -> _Profile:
        _check_points(points)
        if not duration > 0:
            raise ValueError(f"duration {duration!r} must be > 0 seconds")
        times = np.array([t for t, _ in points], dtype=float)
        all_rates = np.array([r for _, r in points], dtype=float)
        all_slopes = np.append(np.diff(all_rates) / np.diff(times), 0.0) if linear else np.zeros_like(times)
        keep = times < duration
        starts, rates, slopes = times[keep], all_rates[keep], all_slopes[keep]
        ends = np.append(starts[1:], duration)
        widths = ends - starts
        areas = rates * widths + 0.5 * slopes * widths**2
        cumulative = np.concatenate([[0.0], np.cumsum(areas)[:-1]])
        return cls(starts, rates, slopes, cumulative, float(np.sum(areas)))

    def inverse(self, u: np.ndarray) -> np.ndarray:
        """t with Λ(t) = u, for 0 <= u < total."""
        j = np.searchsorted(self.cumulative, u, side="right") - 1
        du = u - self.cumulative[j]
        r, s = self.rates[j], self.slopes[j]
        # Λ is quadratic on a segment; this root form stays exact when the slope is 0.
        times: np.ndarray = self.starts[j] + 2 * du / (r + np.sqrt(np.maximum(r * r + 2 * s * du, 0.0)))
        return times


def _warp(profile: _Profile, burstiness: float, seed: int) -> np.ndarray:
    if not burstiness > 0:
        raise ValueError(f"burstiness {burstiness!r} must be > 0")
    rng = np.random.default_rng(seed)
    chunk = max(16, int(profile.total * 1.2) + 64)
    points = np.cumsum(rng.gamma(burstiness, 1.0 / burstiness, chunk))
    while points[-1] < profile.total:
        more = np.cumsum(rng.gamma(burstiness, 1.0 / burstiness, chunk)) + points[-1]
        points = np.concatenate([points, more])
    return profile.inverse(points[points < profile.total])


_BUILDERS: dict[str, Callable[[ArrivalSpec], np.ndarray]] = {
    "poisson": lambda s: poisson(s.rate, s.duration, s.seed),
    "gamma": lambda s: gamma(s.rate, s.burstiness, s.duration, s.seed),
    "burst": lambda s: burst(s.rate, s.burst_size, s.burst_period, s.duration, s.seed, s.burstiness),
    "step": lambda s: step(s.steps, s.duration, s.seed, s.burstiness),
    "ramp": lambda s: ramp(s.steps, s.duration, s.seed, s.burstiness),
}


def build_schedule(spec: ArrivalSpec) -> np.ndarray:
    """The send times (seconds from the start, sorted) that `spec` describes."""
    return _BUILDERS[spec.kind](spec)


def bursts_of(spec: ArrivalSpec) -> np.ndarray:
    """The burst instants of a burst schedule; empty for the other kinds."""
    return burst_times(spec.burst_period, spec.duration) if spec.kind == "burst" else np.empty(0)
