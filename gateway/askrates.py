"""How fast each kind (tenant, priority) asks for tokens, against the other kinds of its band: the headroom's test
of a flood (gateway/fairqueue.py).

A kind with requests queued is not necessarily a flood: once the headroom holds a kind back, its queue grows while
the others are served, so a queue-length test feeds itself. A light tenant caught with two queued in a moment's
burst was held to the last free slots; with the other light tenants always holding one, it waited seconds
(bench.fairness_vllm, run 16 of docs/priority.md). What a kind asks for does not grow with its queue, so it tells a
flood from a burst without that loop: a flood asks at many times the others' rate.

It is counted in tokens (a request's prompt plus its output budget, what fairness charges), not in requests. A flood
of clients each sending as its last answer ends (a closed loop, as batch jobs run) asks for requests only as fast as
it is served: held to 2 slots, eight clients of 32-token requests asked about 2-3 times as often as one light tenant
sending 4-token requests 0.1 s apart, near the factor the test asks for, so they were taken for a flood only part of
the time and took every slot between (tests/test_priority_vllm.py, failed in CI on 2026-11-27;
bench/flood_test_vllm.py). In tokens they asked for about 7 times as many: slots are held for tokens, not for
requests.

Each kind's tokens are counted with an exponential decay (time constant `tau_s`): its rate now. The other kinds are
taken at the rate they asked at when they last asked, not decayed to now: a kind that has gone quiet for a moment
is still one the headroom is kept for, and comparing with its decayed rate made the one kind still asking look like
a flood (run 20). Kinds are kept while they asked within `keep_s` (at most `max_kinds` a band); each band keeps
the sum of its kinds' last rates, so a test costs O(1).
"""

from __future__ import annotations

import math
from collections import OrderedDict

Kind = tuple[str, int]  # (tenant, priority)


class _Band:
    __slots__ = ("at", "kinds", "last_sum")

    def __init__(self) -> None:
        self.at = 0.0  # when a kind of the band last asked
        self.kinds: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (decayed tokens, when), by when
        self.last_sum = 0.0  # the sum of the kinds' decayed tokens as of their last ask


class AskRates:
    """Decayed counts of the tokens each kind asked for, by band."""

    def __init__(self, tau_s: float, keep_s: float, max_bands: int, max_kinds: int = 65536) -> None:
        self.tau_s = tau_s
        self.keep_s = keep_s
        self.max_bands = max_bands
        self.max_kinds = max_kinds  # a band's kinds kept (a tenant header lets clients name any tenant)
        self._bands: dict[int, _Band] = {}

    def ask(self, kind: Kind, now: float, tokens: float = 1.0) -> None:
        """`kind` asked for a slot at `now`, for `tokens`."""
        tenant, priority = kind
        band = self._bands.get(priority)
        if band is None:
            if len(self._bands) >= self.max_bands:  # clients may name any integer: forget the longest silent band
                del self._bands[min(self._bands, key=lambda p: self._bands[p].at)]
            band = self._bands[priority] = _Band()
        band.at = now
        count, at = band.kinds.pop(tenant, (0.0, now))
        band.last_sum -= count
        count = count * self._decay(now - at) + tokens
        band.kinds[tenant] = (count, now)
        band.last_sum += count
        self._forget(band, now)
        if len(band.kinds) > self.max_kinds:  # the least recently asking kind goes first
            band.last_sum -= band.kinds.popitem(last=False)[1][0]

    def asked_within(self, priority: int, now: float, seconds: float) -> bool:
        """Whether a band more urgent than `priority` (a lower value) asked for a slot within `seconds`."""
        return any(p < priority and now - band.at <= seconds for p, band in self._bands.items())

    def outpaces(self, kind: Kind, now: float, factor: float) -> bool:
        """Whether `kind` asks now at more than `factor` x the mean rate the other kinds of its band that asked
        within `keep_s` asked at when they last asked (True when no other kind of its band did)."""
        tenant, priority = kind
        band = self._bands.get(priority)
        if band is None:
            return True
        self._forget(band, now)
        count, at = band.kinds.get(tenant, (0.0, now))
        others = len(band.kinds) - (tenant in band.kinds)
        if others <= 0:
            return True
        rest = max(band.last_sum - count, 0.0)
        return count * self._decay(now - at) > factor * rest / others

    def _forget(self, band: _Band, now: float) -> None:
        """Drop the kinds of `band` silent for more than `keep_s`."""
        kinds = band.kinds
        while kinds:
            oldest = next(iter(kinds))
            count, at = kinds[oldest]
            if now - at <= self.keep_s:
                break
            del kinds[oldest]
            band.last_sum -= count
        if not kinds:
            band.last_sum = 0.0  # (no float drift outlives the band's kinds)

    def _decay(self, seconds: float) -> float:
        return math.exp(-max(seconds, 0.0) / self.tau_s)
