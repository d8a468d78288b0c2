"""How fast each kind (tenant, priority) asks for slots, against the other kinds of its band: the headroom's test of
a flood (gateway/fairqueue.py).

A kind with requests queued is not necessarily a flood: once the headroom holds a kind back, its queue grows while
the others are served, so a queue-length test feeds itself. A light tenant caught with two queued in a moment's
burst was held to the last free slots; with the other light tenants always holding one, it waited seconds
(bench.fairness_vllm, run 16 of docs/priority.md). Requests asked for do not depend on requests served, so they
tell a flood from a burst without that loop: a flood asks at many times the others' rate.

Each kind's asks are counted with an exponential decay (time constant `tau_s`), as is its band's total, so a rate
is read in O(1); the kinds of a band are kept while they asked within `keep_s`.
"""

from __future__ import annotations

import math
from collections import OrderedDict

Kind = tuple[str, int]  # (tenant, priority)


class _Band:
    __slots__ = ("total", "at", "kinds")

    def __init__(self) -> None:
        self.total = 0.0  # the band's decayed asks, as of `at`
        self.at = 0.0
        self.kinds: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (decayed asks, as of), by last


class AskRates:
    """Decayed counts of the slots each kind asked for, by band."""

    def __init__(self, tau_s: float, keep_s: float, max_bands: int) -> None:
        self.tau_s = tau_s
        self.keep_s = keep_s
        self.max_bands = max_bands
        self._bands: dict[int, _Band] = {}

    def ask(self, kind: Kind, now: float) -> None:
        """`kind` asked for one slot at `now`."""
        tenant, priority = kind
        band = self._bands.get(priority)
        if band is None:
            if len(self._bands) >= self.max_bands:  # clients may name any integer: forget the longest silent band
                del self._bands[min(self._bands, key=lambda p: self._bands[p].at)]
            band = self._bands[priority] = _Band()
        band.total = band.total * self._decay(now - band.at) + 1.0
        band.at = now
        count, at = band.kinds.pop(tenant, (0.0, now))
        band.kinds[tenant] = (count * self._decay(now - at) + 1.0, now)
        self._forget(band, now)

    def asked_within(self, priority: int, now: float, seconds: float) -> bool:
        """Whether a band more urgent than `priority` (a lower value) asked for a slot within `seconds`."""
        return any(p < priority and now - band.at <= seconds for p, band in self._bands.items())

    def outpaces(self, kind: Kind, now: float, factor: float) -> bool:
        """Whether `kind` asks at more than `factor` x the mean rate of the other kinds of its band that asked
        within `keep_s` (True when no other kind of its band did)."""
        tenant, priority = kind
        band = self._bands.get(priority)
        if band is None:
            return True
        self._forget(band, now)
        count, at = band.kinds.get(tenant, (0.0, now))
        mine = count * self._decay(now - at)
        others = len(band.kinds) - (tenant in band.kinds)
        if others <= 0:
            return True
        rest = max(band.total * self._decay(now - band.at) - mine, 0.0)
        return mine > factor * rest / others

    def _forget(self, band: _Band, now: float) -> None:
        """Drop the kinds of `band` silent for more than `keep_s`."""
        kinds = band.kinds
        while kinds:
            oldest = next(iter(kinds))
            if now - kinds[oldest][1] <= self.keep_s:
                break
            del kinds[oldest]

    def _decay(self, seconds: float) -> float:
        return math.exp(-max(seconds, 0.0) / self.tau_s)
