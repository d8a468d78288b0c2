"""A replica's speed as the planner measures it: decode step time at each batch size, and prefill tokens/s.

`estimated_ttft` and `prefix_affinity` turn a replica's outstanding tokens into seconds with it. Without a
measured profile the defaults below are used: the simulator's OPT-1.3B on an H100 (docs/sim.md), a decode step of
3.6 ms alone and 10.4 ms at batch 64, and 200,000 prompt tokens/s. Between replicas of one model on one GPU only
the ratios matter (how long a step is against how long a prompt takes), and those change less across models and
GPUs than the absolute figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_STEP_S = ((1, 0.0036), (8, 0.0044), (16, 0.0052), (32, 0.0070), (64, 0.0104), (128, 0.0174),
                  (256, 0.0312), (512, 0.0589))
DEFAULT_PREFILL_TOKENS_S = 200_000.0
_TABLE = 1024  # batch sizes looked up in a table; larger ones extrapolated from its last step


class SpeedError(ValueError):
    """A speed value is wrong; the message names it."""


@dataclass(frozen=True)
class Speed:
    """Decode step seconds at measured batch sizes (interpolated between them) and prefill tokens per second."""

    step_s: tuple[tuple[int, float], ...] = DEFAULT_STEP_S
    prefill_tokens_s: float = DEFAULT_PREFILL_TOKENS_S
    table: tuple[float, ...] = field(init=False, repr=False, compare=False)  # step(b) for b < 1024, precomputed

    def __post_init__(self) -> None:
        if not self.step_s:
            raise SpeedError("speed.step_s needs at least one (batch size, seconds) point")
        batches = [b for b, _ in self.step_s]
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches) or \
                batches != sorted(set(batches)):
            raise SpeedError(f"speed.step_s batch sizes must be distinct positive integers, got {batches!r}")
        if any(not _positive(s) for _, s in self.step_s):
            raise SpeedError(f"speed.step_s seconds must be positive, got {[s for _, s in self.step_s]!r}")
        if not _positive(self.prefill_tokens_s):
            raise SpeedError(f"speed.prefill_tokens_s must be positive, got {self.prefill_tokens_s!r}")
        object.__setattr__(self, "table", tuple(self._interpolate(b) for b in range(_TABLE)))

    def _interpolate(self, batch: int) -> float:
        points = self.step_s
        if len(points) == 1 or batch <= points[0][0]:
            return points[0][1]
        for (b0, s0), (b1, s1) in zip(points, points[1:]):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = points[-2], points[-1]
        return s1 + max(0.0, (s1 - s0) / (b1 - b0)) * (batch - b1)  # past the last point: its slope, never down

    def step(self, batch: int) -> float:
        """Seconds of one decode step at `batch` sequences."""
        return self.table[batch] if batch < _TABLE else self._interpolate(batch)

    @classmethod
    def from_mapping(cls, data: Any, where: str = "speed") -> Speed:
        """From YAML: `{step_s: {1: 0.004, 64: 0.011}, prefill_tokens_s: 150000}` (either key may be left out)."""
        if not isinstance(data, dict):
            raise SpeedError(f"{where} must be a mapping, got {data!r}")
        unknown = sorted(set(map(str, data)) - {"step_s", "prefill_tokens_s"})
        if unknown:
            raise SpeedError(f"unknown key(s) in {where}: {', '.join(unknown)}")
        steps = data.get("step_s", dict(DEFAULT_STEP_S))
        if not isinstance(steps, dict):
            raise SpeedError(f"{where}.step_s must map batch sizes to seconds, got {steps!r}")
        try:
            points = tuple(sorted((_batch(b), float(s)) for b, s in steps.items()))
            prefill = float(data.get("prefill_tokens_s", DEFAULT_PREFILL_TOKENS_S))
        except (TypeError, ValueError) as exc:
            raise SpeedError(f"{where}: {exc}") from None
        return cls(points, prefill)

    def to_mapping(self) -> dict[str, Any]:
        return {"step_s": {b: s for b, s in self.step_s}, "prefill_tokens_s": self.prefill_tokens_s}


def _batch(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
        raise ValueError(f"batch size {value!r} is not a positive integer")
    return int(value)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


DEFAULT_SPEED = Speed()
