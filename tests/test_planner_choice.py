"""The planner's choice of B*: pure logic on the reference CSV and on crafted edge cases."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.choice import (BcaConfig, ChoiceConfig, Slo, bca_choice, choose_batch, explain_difference,
                            monotone_envelope)
from planner.errors import NoFeasibleBatch, PlannerError
from planner.points import Latency, ProfilePoint
from planner.sources import load_profile

REFERENCE = Path(__file__).resolve().parent.parent / "planner" / "data" / "bca-opt-1.3b-h100-single.csv"


def pts(*pairs: tuple[int, float], **kw: object) -> list[ProfilePoint]:
    return [ProfilePoint(batch_size=b, total_tok_s=t, **kw) for b, t in pairs]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference() -> list[ProfilePoint]:
    return list(load_profile(REFERENCE).points)


def test_reference_plateau_gives_256_at_five_percent(reference: list[ProfilePoint]) -> None:
    """On the OPT-1.3B/H100 sweep, B* at epsilon 0.05 is 256: the first B within 5% of the plateau."""
    choice = choose_batch(reference, ChoiceConfig(epsilon=0.05))
    assert choice.batch_size == 256
    # 512, 640 and 768 (11204, 11298, 11050) pool into one envelope value: the plateau
    assert choice.best_tok_s == pytest.approx((11204 + 11298 + 11050) / 3)
    assert choice.best_batch_size == 512
    assert choice.chosen_tok_s == 10810
    assert 10318 < choice.threshold_tok_s <= 10810


@pytest.mark.parametrize(("epsilon", "expected"), [(0.0, 640), (0.02, 384), (0.1, 192), (0.15, 128), (0.2, 96)])
def test_reference_b_star_shrinks_as_epsilon_grows(reference: list[ProfilePoint], epsilon: float,
                                                   expected: int) -> None:
    """A looser epsilon accepts a smaller batch further down the knee."""
    assert choose_batch(reference, ChoiceConfig(epsilon=epsilon)).batch_size == expected


def test_bca_rule_on_reference_picks_128_stopped_by_latency(reference: list[ProfilePoint]) -> None:
    """BCA (L=3 on mean TPOT, efficiency >= 0.1) stops at 128: TPOT 23.8 ms at 192 exceeds 3 x 7.5 ms."""
    bca = bca_choice(reference)
    assert bca.batch_size == 128
    assert bca.latency_metric == "tpot_ms.mean"
    assert bca.reference_batch == 32
    assert bca.latency_limit_ms == pytest.approx(22.5)
    assert bca.largest_efficient == 256  # 10810/(256*381) = 0.111; 384 gives 0.076
    assert bca.efficiency[1] == 1.0


def test_explanation_names_both_picks_and_the_binding_bound(reference: list[ProfilePoint]) -> None:
    """The comparison says which rule picks what and why they differ."""
    text = explain_difference(choose_batch(reference), bca_choice(reference), reference)
    assert "B=256" in text and "BCA picks B=128" in text
    assert "latency bound" in text and "85% of the plateau" in text


def test_bca_with_larger_latency_factor_agrees(reference: list[ProfilePoint]) -> None:
    """With L=5 BCA's latency bound (37.5 ms) and efficiency bound both allow 256: the rules agree."""
    bca = bca_choice(reference, BcaConfig(latency_factor=5))
    assert bca.batch_size == 256
    text = explain_difference(choose_batch(reference), bca, reference)
    assert text.startswith("Both rules pick B=256")


def test_bca_without_batch_one_uses_smallest_profiled_batch() -> None:
    """With no B=1 point, per-sequence throughput at the smallest B stands in for T(1)."""
    points = pts((4, 400.0), (8, 700.0), (16, 1000.0), (32, 1100.0))
    bca = bca_choice(points, BcaConfig(min_efficiency=0.5))
    assert bca.baseline_batch == 4
    assert bca.efficiency[8] == pytest.approx(0.875)
    assert bca.batch_size == 16  # 1000/16 / 100 = 0.625; 32 gives 0.34
    assert bca.latency_metric is None  # these points carry no latencies: the latency bound is not applied


def test_spike_at_small_batch_is_not_taken_for_the_plateau() -> None:
    """A lucky measurement at small B is averaged with its slower neighbour, not chosen."""
    points = pts((32, 9300.0), (64, 8000.0), (128, 9600.0), (256, 9700.0))
    choice = choose_batch(points, ChoiceConfig(epsilon=0.05))
    assert choice.batch_size == 128
    envelope = {c.batch_size: c.envelope_tok_s for c in choice.candidates}
    assert envelope[32] == envelope[64] == pytest.approx(8650.0)


def test_noisy_dip_on_the_plateau_is_averaged() -> None:
    """A dip between two plateau points does not move B* past the first of them."""
    points = pts((64, 8000.0), (128, 9600.0), (256, 9300.0), (512, 9700.0))
    choice = choose_batch(points, ChoiceConfig(epsilon=0.05))
    assert choice.batch_size == 128
    assert choice.best_tok_s == 9700.0


def test_collapse_past_the_peak_does_not_drag_b_star_down() -> None:
    """A large B that collapses is excluded as past the peak instead of pooled into the plateau."""
    points = pts((128, 9500.0), (256, 10800.0), (512, 11200.0), (1024, 6000.0))
    choice = choose_batch(points, ChoiceConfig(epsilon=0.05))
    assert choice.batch_size == 256
    excluded = {c.batch_size: c.excluded for c in choice.candidates}
    assert excluded[1024] is not None and "past the peak" in excluded[1024]


def test_points_with_preemptions_are_excluded() -> None:
    """Preempted points are not candidates and do not set the plateau."""
    points = [ProfilePoint(batch_size=64, total_tok_s=8000.0, preemptions=0),
              ProfilePoint(batch_size=128, total_tok_s=9000.0, preemptions=0),
              ProfilePoint(batch_size=256, total_tok_s=12000.0, preemptions=37)]
    choice = choose_batch(points)
    assert choice.batch_size == 128
    assert choice.best_tok_s == 9000.0
    reason = next(c.excluded for c in choice.candidates if c.batch_size == 256)
    assert reason is not None and "37 preemption" in reason


def test_all_points_preempted_is_a_clear_error() -> None:
    """When every B had preemptions the error says so and what to do."""
    points = [ProfilePoint(batch_size=b, total_tok_s=1000.0 * b, preemptions=3) for b in (64, 128)]
    with pytest.raises(NoFeasibleBatch, match="every profiled batch size had preemptions.*B=64: 3"):
        choose_batch(points)


def test_slo_on_p99_tpot_caps_the_batch() -> None:
    """Only points within the TPOT SLO are candidates; B* is chosen on their plateau."""
    points = [ProfilePoint(batch_size=b, total_tok_s=t, tpot_ms=Latency(p99=lat))
              for b, t, lat in ((32, 5000.0, 10.0), (64, 7000.0, 14.0), (128, 7200.0, 20.0), (256, 9000.0, 40.0))]
    choice = choose_batch(points, ChoiceConfig(epsilon=0.05, slo=Slo(p99_tpot_ms=25)))
    assert choice.batch_size == 64
    assert choice.best_batch_size == 128
    reason = next(c.excluded for c in choice.candidates if c.batch_size == 256)
    assert reason == "p99 TPOT 40 ms > SLO 25 ms"


def test_slo_nothing_meets_is_a_clear_message() -> None:
    """An SLO no point meets raises NoFeasibleBatch naming the lowest latency measured."""
    points = [ProfilePoint(batch_size=b, total_tok_s=1000.0 * b, ttft_ms=Latency(p99=100.0 * b)) for b in (8, 16)]
    with pytest.raises(NoFeasibleBatch, match=r"p99 TTFT <= 50 ms: the lowest measured is 800 ms at B=8"):
        choose_batch(points, ChoiceConfig(slo=Slo(p99_ttft_ms=50)))


def test_slo_on_a_latency_the_profile_lacks_is_a_clear_error(reference: list[ProfilePoint]) -> None:
    """The reference CSV has no p99 TPOT: asking for that SLO names the gap instead of guessing."""
    with pytest.raises(PlannerError, match="no p99 TPOT for B=1"):
        choose_batch(reference, ChoiceConfig(slo=Slo(p99_tpot_ms=30)))


def test_reference_with_p99_itl_slo(reference: list[ProfilePoint]) -> None:
    """p99 ITL <= 50 ms keeps B <= 128 (43.3 ms); within 5% of 9507 tok/s the smallest is 96 (9033)."""
    choice = choose_batch(reference, ChoiceConfig(slo=Slo(p99_itl_ms=50)))
    assert choice.batch_size == 96
    assert choice.best_batch_size == 128


def test_single_point_is_its_own_b_star() -> None:
    """One profiled B is B*."""
    assert choose_batch(pts((16, 100.0))).batch_size == 16


@pytest.mark.parametrize("epsilon", [-0.1, 1.0, 2.0])
def test_bad_epsilon_is_rejected(epsilon: float) -> None:
    """Epsilon outside [0, 1) is a user error naming the value."""
    with pytest.raises(PlannerError, match=f"epsilon must be in \\[0, 1\\), got {epsilon}"):
        ChoiceConfig(epsilon=epsilon)


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=30))
def test_envelope_is_monotone_and_keeps_the_total(values: list[float]) -> None:
    """Isotonic regression gives a non-decreasing fit with the same sum as the data."""
    fit = monotone_envelope(values)
    assert len(fit) == len(values)
    assert all(a <= b * (1 + 1e-12) + 1e-9 for a, b in zip(fit, fit[1:]))
    assert sum(fit) == pytest.approx(sum(values), rel=1e-9, abs=1e-6)


def test_envelope_of_monotone_data_is_the_data() -> None:
    """Already non-decreasing measurements are left as they are."""
    assert monotone_envelope([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
