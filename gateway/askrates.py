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

A kind that has just started asking (or started again after `keep_s` of silence) has had no time to build up its
count: a flood's first requests counted about as much as a light tenant's last second, so for the flood's first
0.2-0.3 s the test said "no flood" and the flood took every free slot (the tenants case's "early" slow requests,
docs/priority.md). So a kind's rate is read as a moving average started at zero is corrected: what it asked for
after its first request, over the share of a steady rate's count it could have built since, `1 - exp(-age /
tau_s)` (with `age` at least `min_age_s`, so two requests together are not a rate without bound). A steady kind's
age is long and its correction nil. A kind's first request alone says nothing of its rate: it counts as is, as
before, except in a band whose kinds have just started asking together (a fresh gateway), where it is read over
the band's age as a second request is over its kind's (`_first_rate`). So a new kind asking at 10 x the others'
rate outpaces them from its second request, and the queue holds a kind with nothing queued once it has asked twice
and asks at 4 x the others' rate (`PriorityOrder.FLOOD_ASKS`, `ALONE_X`, gateway/fairqueue.py): a flood's first
requests, and a flood whose queue has emptied for a moment. Not at 2 x: a steady light tenant's count, its
requests' lengths drawn as they come, goes past twice the others' now and then, and held with nothing queued it
waited 0.1-0.2 s (bench.fairness_vllm run 39).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

Kind = tuple[str, int]  # (tenant, priority)


class _Asker(NamedTuple):
    tokens: float  # tokens asked for, decayed to `at`
    at: float  # when it last asked
    since: float  # when it started asking (again, after `keep_s` of silence)
    first: float  # the tokens it asked for then
    asks: int  # requests asked for since then
    rate: float  # its rate at `at` (`_rate`): what it adds to its band's `last_sum`


class _Band:
    __slots__ = ("at", "kinds", "last_sum", "since")

    def __init__(self, now: float) -> None:
        self.at = 0.0  # when a kind of the band last asked
        self.since = now  # when its kinds started asking (again, after every one had gone silent)
        self.kinds: OrderedDict[str, _Asker] = OrderedDict()  # by tenant, least recently asking first
        self.last_sum = 0.0  # the sum of the kinds' rates as of their last ask


class AskRates:
    """Decayed counts of the tokens each kind asked for, by band."""

    def __init__(self, tau_s: float, keep_s: float, max_bands: int, max_kinds: int = 65536,
                 min_age_s: float = 0.1, first_age_s: float = 0.25) -> None:
        self.tau_s = tau_s
        self.keep_s = keep_s
        self.max_bands = max_bands
        self.max_kinds = max_kinds  # a band's kinds kept (a tenant header lets clients name any tenant)
        self.min_age_s = min_age_s  # the shortest time a new kind's count is taken to have been built over
        self.first_age_s = first_age_s  # ... and a young band's first requests (`_first_rate`)
        self._bands: dict[int, _Band] = {}

    def ask(self, kind: Kind, now: float, tokens: float = 1.0) -> None:
        """`kind` asked for a slot at `now`, for `tokens`."""
        tenant, priority = kind
        band = self._bands.get(priority)
        if band is None:
            if len(self._bands) >= self.max_bands:  # clients may name any integer: forget the longest silent band
                del self._bands[min(self._bands, key=lambda p: self._bands[p].at)]
            band = self._bands[priority] = _Band(now)
        band.at = now
        self._forget(band, now)  # (first: a kind silent past keep_s starts again)
        if not band.kinds:
            band.since = now
        old = band.kinds.pop(tenant, None)
        if old is None:
            asker = _Asker(tokens, now, now, tokens, 1, self._first_rate(tokens, now - band.since))
        else:
            band.last_sum -= old.rate
            count, asks = old.tokens * self._decay(now - old.at) + tokens, old.asks + 1
            asker = _Asker(count, now, old.since, old.first, asks, self._rate(count, asks, old, now))
        band.kinds[tenant] = asker
        band.last_sum += asker.rate
        if len(band.kinds) > self.max_kinds:  # the least recently asking kind goes first
            band.last_sum -= band.kinds.popitem(last=False)[1].rate

    def asked_within(self, priority: int, now: float, seconds: float) -> bool:
        """Whether a band more urgent than `priority` (a lower value) asked for a slot within `seconds`."""
        return any(p < priority and now - band.at <= seconds for p, band in self._bands.items())

    def outpaces(self, kind: Kind, now: float, factor: float, asks: int = 0) -> bool:
        """Whether `kind` asks now at more than `factor` x the mean rate the other kinds of its band that asked
        within `keep_s` asked at when they last asked: False when no other kind of its band did (nobody is there
        to keep a slot for), and False until `kind` has asked `asks` times since it started."""
        tenant, priority = kind
        band = self._bands.get(priority)
        if band is None:
            return False
        self._forget(band, now)
        mine = band.kinds.get(tenant)
        others = len(band.kinds) - (mine is not None)
        if others <= 0 or mine is None or mine.asks < asks:
            return False
        rest = max(band.last_sum - mine.rate, 0.0)
        return self._rate(mine.tokens * self._decay(now - mine.at), mine.asks, mine, now) > factor * rest / others

    def _forget(self, band: _Band, now: float) -> None:
        """Drop the kinds of `band` silent for more than `keep_s`."""
        kinds = band.kinds
        while kinds:
            oldest = next(iter(kinds))
            asker = kinds[oldest]
            if now - asker.at <= self.keep_s:
                break
            del kinds[oldest]
            band.last_sum -= asker.rate
        if not kinds:
            band.last_sum = 0.0  # (no float drift outlives the band's kinds)

    def _rate(self, count: float, asks: int, asker: _Asker, now: float) -> float:
        """A kind's `count` at `now`, of `asks` requests since `asker.since`, as a steady rate's would be: what it
        asked for after its first request (one request alone says nothing of a rate, so it is taken as is), over
        the share of a steady rate's count it can have built in the time since (at least `min_age_s`)."""
        if asks == 1:
            return count
        age = now - asker.since
        return (count - asker.first * self._decay(age)) / -math.expm1(-max(age, self.min_age_s) / self.tau_s)

    def _first_rate(self, tokens: float, band_age: float) -> float:
        """A kind's rate on its first request, in a band whose kinds started asking `band_age` ago: as is in a
        band that has been asking (one request says nothing of a rate), but in a band that has just started
        (a fresh gateway: every kind new) as if the request were the count of the band's age, as a second request
        is read over the kind's age. Else, at a cold start, a tenant whose second request came close behind its
        first asked at ten times the others' first requests, and was held as a flood (bench.fairness_vllm:
        1-6 requests 0.1-0.25 s in the gateway's queue in the first phase of runs 38, 39, 41 and 43). Read over
        at least `first_age_s`, not `min_age_s`: a flood starting with the band is still held from its fourth
        request or so, as before (docs/priority.md)."""
        return tokens / -math.expm1(-max(band_age, self.first_age_s) / self.tau_s)

    def _decay(self, seconds: float) -> float:
        return math.exp(-max(seconds, 0.0) / self.tau_s)
