"""Choosing the batch cap B*: pure functions over profile points.

The rule (this planner's):

1. Drop points with preemptions: their throughput was bought by recomputing evicted requests, a sign the KV
   pool was too small for that B; it does not hold in a replica sized for B.
2. Drop points past the peak: larger than the best-throughput B and more than epsilon below it. A larger cap
   that is slower is never the answer, and a real collapse is not noise to be averaged into the fit.
3. Fit a monotone (non-decreasing) envelope to the rest by isotonic regression (pool adjacent violators):
   measurements are noisy and throughput does not really fall with more batch, so a dip is averaged with its
   neighbour and a lucky spike at small B cannot pass for the plateau.
4. Keep the points that meet the latency SLOs (p99 TPOT / TTFT / ITL) given.
5. B* = the smallest kept B whose envelope is within epsilon of the best kept envelope value.

Beside it, `bca_choice` applies the Batching Configuration Advisor rule of arXiv 2503.08311: the largest B
whose efficiency T(B) / (B * T(1)) is at least a threshold and whose latency is at most L times the latency at
B=32. `explain_difference` says in words why the two differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from planner.errors import NoFeasibleBatch, PlannerError
from planner.points import ProfilePoint

_TOLERANCE = 1e-9
SLO_METRICS = {"p99_tpot_ms": ("tpot_ms.p99", "p99 TPOT"), "p99_ttft_ms": ("ttft_ms.p99", "p99 TTFT"),
               "p99_itl_ms": ("itl_ms.p99", "p99 ITL")}


@dataclass(frozen=True)
class Slo:
    """Latency ceilings in milliseconds (None: no ceiling)."""

    p99_tpot_ms: float | None = None
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None

    def __post_init__(self) -> None:
        for name in SLO_METRICS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise PlannerError(f"SLO {name} must be a positive number of milliseconds, got {value!r}")

    def limits(self) -> list[tuple[str, str, float]]:
        """(metric, label, ceiling) for each SLO given."""
        return [(*SLO_METRICS[name], getattr(self, name)) for name in SLO_METRICS if getattr(self, name) is not None]


@dataclass(frozen=True)
class ChoiceConfig:
    """How B* is chosen."""

    epsilon: float = 0.05
    slo: Slo = field(default_factory=Slo)

    def __post_init__(self) -> None:
        if not 0 <= self.epsilon < 1:
            raise PlannerError(f"epsilon must be in [0, 1), got {self.epsilon!r}")


@dataclass(frozen=True)
class Candidate:
    """One profiled B as the rule saw it."""

    batch_size: int
    measured_tok_s: float
    envelope_tok_s: float | None  # None: excluded before the fit
    excluded: str | None = None  # why it cannot be B* (None: it could)


@dataclass(frozen=True)
class Choice:
    """B* and the numbers it came from."""

    batch_size: int
    epsilon: float
    best_tok_s: float
    best_batch_size: int
    threshold_tok_s: float
    chosen_tok_s: float
    candidates: tuple[Candidate, ...]
    slo: Slo = field(default_factory=Slo)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["candidates"] = [asdict(c) for c in self.candidates]
        return data


def monotone_envelope(values: Sequence[float]) -> list[float]:
    """The non-decreasing least-squares fit to `values` (isotonic regression, pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (sum, count) of pooled neighbours
    for value in values:
        total, count = value, 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            prev_total, prev_count = blocks.pop()
            total, count = total + prev_total, count + prev_count
        blocks.append((total, count))
    return [total / count for total, count in blocks for _ in range(count)]


def _preempted(point: ProfilePoint) -> str | None:
    if point.preemptions:
        return f"{point.preemptions} preemption(s): the KV pool was too small for this B"
    return None


def _past_peak(points: Sequence[ProfilePoint], epsilon: float) -> dict[int, str]:
    peak = max(points, key=lambda p: (p.total_tok_s, -p.batch_size))
    floor = (1 - epsilon) * peak.total_tok_s
    return {p.batch_size: f"past the peak: {p.total_tok_s:.4g} tok/s is more than {epsilon:.0%} below "
                          f"{peak.total_tok_s:.4g} at B={peak.batch_size}"
            for p in points if p.batch_size > peak.batch_size and p.total_tok_s < floor}


def _slo_violation(point: ProfilePoint, slo: Slo) -> str | None:
    for metric, label, ceiling in slo.limits():
        value = point.latency(metric)
        if value is None:
            raise PlannerError(f"the profile has no {label} for B={point.batch_size}, so the {label} SLO cannot "
                               f"be checked (a CSV may have only some latencies; drop that SLO or use another)")
        if value > ceiling:
            return f"{label} {value:.4g} ms > SLO {ceiling:g} ms"
    return None


def choose_batch(points: Sequence[ProfilePoint], config: ChoiceConfig | None = None) -> Choice:
    """B*: the smallest profiled B within epsilon of the best, on the monotone envelope; see the module doc."""
    config = config or ChoiceConfig()
    points = sorted(points, key=lambda p: p.batch_size)
    if not points:
        raise NoFeasibleBatch("the profile has no points")
    excluded = {p.batch_size: reason for p in points if (reason := _preempted(p))}
    clean = [p for p in points if p.batch_size not in excluded]
    if not clean:
        raise NoFeasibleBatch("every profiled batch size had preemptions "
                              f"({', '.join(f'B={p.batch_size}: {p.preemptions}' for p in points)}); profile "
                              "smaller batch sizes or give the replica more KV-cache memory")
    excluded.update(_past_peak(clean, config.epsilon))
    fitted = [p for p in clean if p.batch_size not in excluded]
    envelope = dict(zip([p.batch_size for p in fitted], monotone_envelope([p.total_tok_s for p in fitted])))
    for p in fitted:
        if (reason := _slo_violation(p, config.slo)) is not None:
            excluded[p.batch_size] = reason
    candidates = tuple(Candidate(p.batch_size, p.total_tok_s, envelope.get(p.batch_size), excluded.get(p.batch_size))
                       for p in points)
    feasible = [c for c in candidates if c.excluded is None and c.envelope_tok_s is not None]
    if not feasible:
        raise NoFeasibleBatch(_nothing_meets(points, config.slo, excluded))
    best = max(feasible, key=lambda c: (c.envelope_tok_s, -c.batch_size))
    assert best.envelope_tok_s is not None
    threshold = (1 - config.epsilon) * best.envelope_tok_s
    chosen = next(c for c in feasible if c.envelope_tok_s is not None
                  and c.envelope_tok_s >= threshold * (1 - _TOLERANCE))
    assert chosen.envelope_tok_s is not None
    return Choice(batch_size=chosen.batch_size, epsilon=config.epsilon, best_tok_s=best.envelope_tok_s,
                  best_batch_size=best.batch_size, threshold_tok_s=threshold, chosen_tok_s=chosen.envelope_tok_s,
                  candidates=candidates, slo=config.slo)


def _nothing_meets(points: Sequence[ProfilePoint], slo: Slo, excluded: dict[int, str]) -> str:
    parts = []
    for metric, label, ceiling in slo.limits():
        measured = [(v, p.batch_size) for p in points
                    if p.batch_size in excluded and not p.preemptions and (v := p.latency(metric)) is not None]
        if measured:
            lowest, at = min(measured)
            if lowest > ceiling:
                parts.append(f"{label} <= {ceiling:g} ms: the lowest measured is {lowest:.4g} ms at B={at}")
    detail = "; ".join(parts) or "; ".join(f"B={b}: {why}" for b, why in sorted(excluded.items()))
    return (f"no profiled batch size meets the SLOs ({detail}); relax the SLO, or profile smaller batch "
            "sizes (--batch-sizes)")


# --- the BCA rule of arXiv 2503.08311, for comparison -------------------------------------------------------


@dataclass(frozen=True)
class BcaConfig:
    """The BCA rule's knobs: efficiency threshold, latency factor L, which latency, the reference batch."""

    min_efficiency: float = 0.1
    latency_factor: float = 3.0
    latency_metrics: tuple[str, ...] = ("tpot_ms.mean", "itl_ms.mean")  # the first one the profile has
    reference_batch: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.min_efficiency <= 1:
            raise PlannerError(f"BCA efficiency threshold must be in (0, 1], got {self.min_efficiency!r}")
        if not self.latency_factor >= 1:
            raise PlannerError(f"BCA latency factor L must be >= 1, got {self.latency_factor!r}")


@dataclass(frozen=True)
class BcaChoice:
    """What the BCA rule picks, and which of its bounds stopped it."""

    batch_size: int | None
    efficiency: dict[int, float]
    baseline_batch: int
    reference_batch: int | None
    latency_metric: str | None
    latency_limit_ms: float | None
    largest_efficient: int | None
    largest_within_latency: int | None
    config: BcaConfig

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["efficiency"] = {b: round(e, 4) for b, e in self.efficiency.items()}
        data["config"]["latency_metrics"] = list(self.config.latency_metrics)
        return data


def bca_choice(points: Sequence[ProfilePoint], config: BcaConfig | None = None) -> BcaChoice:
    """The largest B with T(B)/(B*T(b0)/b0) >= threshold and latency <= L x latency(B nearest 32).

    b0 is the smallest profiled B (1 in the paper; per-sequence throughput at b0 stands in for T(1) when B=1
    was not profiled). Points with preemptions are left out, as the paper's authors left those runs out.
    """
    config = config or BcaConfig()
    clean = sorted((p for p in points if not p.preemptions), key=lambda p: p.batch_size)
    if not clean:
        raise NoFeasibleBatch("every profiled batch size had preemptions")
    base = clean[0]
    per_seq = base.total_tok_s / base.batch_size
    efficiency = {p.batch_size: (p.total_tok_s / p.batch_size) / per_seq if per_seq else 0.0 for p in clean}
    efficient = [p for p in clean if efficiency[p.batch_size] >= config.min_efficiency - _TOLERANCE]
    metric = next((m for m in config.latency_metrics if all(p.latency(m) is not None for p in clean)), None)
    reference, limit, within = None, None, list(clean)
    if metric is not None:
        ref = min(clean, key=lambda p: (abs(p.batch_size - config.reference_batch), p.batch_size))
        reference, ref_latency = ref.batch_size, ref.latency(metric)
        assert ref_latency is not None
        limit = config.latency_factor * ref_latency
        within = [p for p in clean if (p.latency(metric) or 0.0) <= limit * (1 + _TOLERANCE)]
    both = {p.batch_size for p in efficient} & {p.batch_size for p in within}
    return BcaChoice(
        batch_size=max(both, default=None), efficiency=efficiency,
        baseline_batch=base.batch_size, reference_batch=reference, latency_metric=metric, latency_limit_ms=limit,
        largest_efficient=max((p.batch_size for p in efficient), default=None),
        largest_within_latency=max((p.batch_size for p in within), default=None), config=config)


def explain_difference(choice: Choice, bca: BcaChoice, points: Sequence[ProfilePoint]) -> str:
    """Why this planner's B* and the BCA rule's pick agree or differ, in a few sentences."""
    by_b = {p.batch_size: p for p in points}
    ours = (f"This planner picks B={choice.batch_size}: the smallest B whose envelope throughput "
            f"({choice.chosen_tok_s:.0f} tok/s) is within {choice.epsilon:.0%} of the best "
            f"({choice.best_tok_s:.0f} tok/s at B={choice.best_batch_size}); latency bounds it only through the "
            f"SLOs given.")
    if bca.batch_size is None:
        return (f"{ours} The BCA rule picks nothing: no B meets both its efficiency bound "
                f"(>= {bca.config.min_efficiency:g}) and its latency bound ({_latency_bound(bca)}).")
    if bca.batch_size == choice.batch_size:
        return f"Both rules pick B={choice.batch_size}. {ours}"
    stops = []
    if bca.largest_within_latency == bca.batch_size and bca.latency_limit_ms is not None:
        stops.append(f"its latency bound ({_latency_bound(bca)})")
    if bca.largest_efficient == bca.batch_size:
        stops.append(f"its efficiency bound (T(B)/(B*T({bca.baseline_batch})/{bca.baseline_batch}) >= "
                     f"{bca.config.min_efficiency:g})")
    theirs = (f"BCA picks B={bca.batch_size}, the largest B its bounds allow; it is stopped by "
              f"{' and '.join(stops) or 'the largest profiled B'}.")
    picked = by_b[bca.batch_size]
    share = picked.total_tok_s / choice.best_tok_s if choice.best_tok_s else 0.0
    if bca.batch_size < choice.batch_size:
        why = (f"BCA trades throughput for latency: B={bca.batch_size} measured {picked.total_tok_s:.0f} tok/s, "
               f"{share:.0%} of the plateau; this planner asks for {1 - choice.epsilon:.0%} of it and leaves "
               "latency to explicit SLOs.")
    else:
        why = (f"BCA goes further along the plateau: B={bca.batch_size} measured {picked.total_tok_s:.0f} tok/s "
               f"({share:.0%} of the best) for more latency and more KV memory per replica; this planner stops "
               f"where more batch buys less than {choice.epsilon:.0%}, so the memory can hold another replica.")
    return f"{ours} {theirs} {why}"


def _latency_bound(bca: BcaChoice) -> str:
    if bca.latency_limit_ms is None or bca.latency_metric is None:
        return "not applied: the profile has no mean TPOT or ITL"
    return (f"{bca.latency_metric} <= {bca.config.latency_factor:g} x its value at B={bca.reference_batch} = "
            f"{bca.latency_limit_ms:.4g} ms")
