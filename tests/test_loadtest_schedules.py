"""Arrival schedules: their statistics, bursts, steps and ramps, seeding and validation."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.schedules import ArrivalSpec, build_schedule, burst, burst_times, gamma, poisson, ramp, step


def _cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(np.std(gaps) / np.mean(gaps))


def test_poisson_gaps_have_mean_one_over_rate_and_cv_one() -> None:
    """Poisson gaps average 1/rate with a coefficient of variation near 1."""
    times = poisson(rate=20.0, duration=1000.0, seed=1)
    assert len(times) == pytest.approx(20_000, rel=0.03)
    assert np.mean(np.diff(times)) == pytest.approx(1 / 20.0, rel=0.02)
    assert _cv(times) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("k", [0.25, 0.5, 1.0, 4.0])
def test_gamma_cv_is_one_over_sqrt_k_at_the_same_mean_rate(k: float) -> None:
    """Gamma gaps keep the mean rate and have CV 1/sqrt(k)."""
    times = gamma(rate=10.0, burstiness=k, duration=2000.0, seed=2)
    assert np.mean(np.diff(times)) == pytest.approx(0.1, rel=0.05)
    assert _cv(times) == pytest.approx(1 / np.sqrt(k), rel=0.07)


def test_schedules_are_sorted_inside_the_window_and_seeded() -> None:
    """Times are sorted, in [0, duration), equal for equal seeds and differ across seeds."""
    a, b, c = poisson(5.0, 60.0, seed=7), poisson(5.0, 60.0, seed=7), poisson(5.0, 60.0, seed=8)
    assert np.all(np.diff(a) >= 0) and a[0] >= 0 and a[-1] < 60.0
    assert np.array_equal(a, b)
    assert not np.array_equal(a[: min(len(a), len(c))], c[: min(len(a), len(c))])


def test_bursts_land_at_each_period_with_their_size_on_top_of_the_base_rate() -> None:
    """burst_size requests share each burst instant (period, 2*period, ...); the rest is the base process."""
    times = burst(base_rate=4.0, burst_size=25, period=10.0, duration=100.0, seed=3)
    instants = burst_times(10.0, 100.0)
    assert instants.tolist() == [10.0 * i for i in range(1, 10)]
    values, counts = np.unique(times, return_counts=True)
    assert {float(v): int(n) for v, n in zip(values, counts) if n > 1} == {float(t): 25 for t in instants}
    base = times[~np.isin(times, instants)]
    assert len(base) == pytest.approx(400, rel=0.15)


def test_burst_with_no_base_rate_is_only_the_bursts() -> None:
    """A zero base rate leaves the bursts alone."""
    times = burst(base_rate=0.0, burst_size=8, period=5.0, duration=20.0)
    assert times.tolist() == [5.0] * 8 + [10.0] * 8 + [15.0] * 8


def test_steps_hold_each_rate_over_their_interval() -> None:
    """Each step's count matches its rate times its length, and a zero step is silent."""
    times = step([(0.0, 5.0), (100.0, 0.0), (150.0, 20.0)], duration=250.0, seed=4)
    assert np.sum(times < 100) == pytest.approx(500, rel=0.12)
    assert np.sum((times >= 100) & (times < 150)) == 0
    assert np.sum(times >= 150) == pytest.approx(2000, rel=0.06)


def test_ramp_rate_grows_linearly() -> None:
    """A ramp from 0 to 20 req/s over 100 s gives a quarter of its requests in the first half."""
    times = ramp([(0.0, 0.0), (100.0, 20.0)], duration=100.0, seed=5)
    assert len(times) == pytest.approx(1000, rel=0.08)
    assert np.sum(times < 50) / len(times) == pytest.approx(0.25, abs=0.04)


def test_ramp_stays_flat_after_its_last_point_and_steps_beyond_duration_are_ignored() -> None:
    """Past the last point the rate holds; points past the end do not matter."""
    times = ramp([(0.0, 10.0), (50.0, 10.0), (500.0, 1000.0)], duration=100.0, seed=6)
    flat = ramp([(0.0, 10.0), (50.0, 10.0)], duration=100.0, seed=6)
    assert len(flat) == pytest.approx(1000, rel=0.1)
    assert len(times) > len(flat)  # the rate starts climbing at 50 s towards 1000 req/s at 500 s


def test_build_schedule_dispatches_on_kind() -> None:
    """build_schedule gives the function of the spec's kind with its parameters."""
    spec = ArrivalSpec(kind="gamma", rate=3.0, burstiness=0.5, duration=30.0, seed=9)
    assert np.array_equal(build_schedule(spec), gamma(3.0, 0.5, 30.0, seed=9))
    spec = ArrivalSpec(kind="step", steps=((0.0, 1.0), (10.0, 3.0)), duration=20.0, seed=9)
    assert np.array_equal(build_schedule(spec), step([(0.0, 1.0), (10.0, 3.0)], 20.0, seed=9))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "uniform"}, "arrival 'uniform'"),
    ({"rate": 0.0}, "rate 0.0"),
    ({"duration": -1.0}, "duration -1.0"),
    ({"kind": "poisson", "burstiness": 0.5}, "needs --arrival gamma"),
    ({"kind": "gamma", "burstiness": 0.0}, "burstiness 0.0"),
    ({"kind": "burst", "burst_size": 0}, "burst size 0"),
    ({"kind": "step"}, "steps are empty"),
    ({"kind": "step", "steps": ((5.0, 1.0),)}, "start at time 0"),
    ({"kind": "ramp", "steps": ((0.0, 1.0), (0.0, 2.0))}, "must increase"),
    ({"kind": "step", "steps": ((0.0, 0.0),)}, "one > 0"),
])
def test_bad_specs_name_the_bad_value(kwargs: dict, message: str) -> None:
    """Invalid arrival parameters are refused with the value in the message."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ArrivalSpec(**kwargs)
