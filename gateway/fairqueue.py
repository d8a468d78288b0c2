"""The admission queue's order when priorities or fairness are on: priority first, then tenants' tokens served.

Without an order the router's queue is first come, first served (gateway/router.py). With one, a waiter's place is
`(priority, its tenant's virtual token counter, arrival)`: a lower priority value first (vLLM's convention), and
within a priority the tenant that has been served the fewest tokens, as in the Virtual Token Counter of Sheng et al.,
"Fairness in Serving Large Language Models" (OSDI 2024):

- every lease a tenant takes (queued or not) adds its cost to the tenant's counter: prompt tokens plus the output
  budget, the same tokens the gateway reserves on the replica (the gateway cannot know the output in advance);
  when the answer is in, the budget it did not use is given back (all of it for a lease that failed before an
  answer: gateway/settlement.py), so the counter ends up counting the tokens served;
- a tenant that starts waiting with nobody of its own queued has its counter lifted to the least counter among
  the tenants waiting (or, with the queue empty, to that of the last tenant to leave it), so a tenant cannot bank
  credit while idle and then take the replicas over.

Headroom (`queue.headroom`, default 0): the last `headroom` of each replica's `max_requests` are kept from floods.
A kind (tenant and priority) asking for tokens faster than twice the mean of the other kinds of its band
(gateway/askrates.py) is held to `max_requests - headroom` when it has others queued, and with nothing else queued
once it has asked twice since it started and asks at 4 x that mean (a flood's first requests, or a flood whose
queue has emptied for a moment). A burst, queued only because it was held, asks no faster than the others and is
not held; nor is a kind whose tenant has fewer queued than another tenant of
its band, or one more urgent than another kind queued. A less urgent band never takes them while a more urgent
one is queued or asked for a slot within `queue.headroom_idle_s`, queued or not: a batch flood's
first requests, which find nothing of their own queued, cannot take the slots interactive requests use. A
tenant or band sending past its share always has requests queued, so it fills replicas only up to
`max_requests - headroom`; a request of anyone within their share
then finds a free batch slot at once instead of waiting for one to free (its time to first token stays what it is
with the pool to itself). It costs `headroom / max_requests` of the batch while a flood lasts: near the throughput
plateau the planner's batch cap sits on, little throughput. It is lent while nobody else uses it: when no other
kind of its band (nor a more urgent one) has asked for a slot for `queue.headroom_idle_s` (default 10 s), a flood
alone fills the replicas; the first request of another kind then waits for one slot to free, and from then on the
headroom is kept again. Asking is counted when a request arrives, not when it leaves the queue: a flood's queue
draining for seconds after its last request is not another kind asking (it held the one kind still asking to the
last free slots: docs/priority.md).

Counters are kept for the `MAX_TENANTS` most recently seen tenants; a forgotten one starts again at the lift.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from .askrates import AskRates
from .parsing import RequestInfo


def _loop_time() -> float:
    return asyncio.get_running_loop().time()  # the loop's clock: virtual in the simulator's runs


class QueueOrder(Protocol):
    """What the router asks of a queue discipline; `key` orders waiters, smallest first. With `fair`, a full queue
    refuses the latest waiter of the tenant with the most queued to make room for another tenant's request."""

    fair: bool

    def key(self, info: RequestInfo, seq: int) -> tuple[int, float, int]: ...

    def arrive(self, info: RequestInfo) -> None: ...

    def leave(self, info: RequestInfo) -> None: ...

    def charge(self, info: RequestInfo) -> None: ...

    def refused(self, info: RequestInfo) -> None: ...

    def reserve(self, info: RequestInfo) -> int: ...


class PriorityOrder:
    """Priority bands, then within each either arrival (fair False) or tokens served per tenant (fair True)."""

    MAX_TENANTS = 65536
    MAX_BANDS = 64  # bands whose asking rates are kept (clients may name any integer priority)
    ASK_TAU_S = 1.0  # time constant of the kinds' asking rates
    FLOOD_X = 2.0  # a kind asking for tokens past this many times the mean of the others of its band is a flood
    FLOOD_ASKS = 2  # ... held with nothing else of its own queued once it has asked this often since it started,
    ALONE_X = 2.0  # ... and asks at this many times FLOOD_X (a steady tenant's count crosses FLOOD_X by chance)

    def __init__(self, fair: bool, headroom: int = 0, idle_s: float = 10.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.fair = fair
        self.headroom = headroom
        self.idle_s = idle_s  # the headroom is lent to a flood when no other kind asked for this long
        self._clock = clock or _loop_time
        self._asks = AskRates(self.ASK_TAU_S, idle_s, self.MAX_BANDS, self.MAX_TENANTS)  # only with a headroom
        self.counters: OrderedDict[str, float] = OrderedDict()
        self._waiting: dict[str, int] = {}  # tenants with requests queued, and how many
        self._kinds: dict[tuple[str, int], int] = {}  # the same by (tenant, priority), for the headroom
        self._priorities: dict[int, int] = {}  # ... and by priority
        self._last = 0.0  # the counter of the last tenant to leave the queue

    def key(self, info: RequestInfo, seq: int) -> tuple[int, float, int]:
        counter = self.counters.get(info.tenant, 0.0) if self.fair else 0.0
        return info.priority or 0, counter, seq

    def arrive(self, info: RequestInfo) -> None:
        """`info` starts waiting."""
        tenant = info.tenant
        waiting = self._waiting.get(tenant, 0)
        if self.fair and not waiting:
            counters = self.counters
            floor = min((counters.get(t, 0.0) for t in self._waiting), default=self._last)
            self._set(tenant, max(counters.get(tenant, 0.0), floor))
        self._waiting[tenant] = waiting + 1
        priority = info.priority or 0
        kind = (tenant, priority)
        self._kinds[kind] = self._kinds.get(kind, 0) + 1
        self._priorities[priority] = self._priorities.get(priority, 0) + 1
        self._ask(info)  # a new request (only new ones start waiting)

    def reserve(self, info: RequestInfo) -> int:
        """Slots of each replica `info` must leave free: the headroom when a more urgent priority is queued or asked
        for a slot within `idle_s` (whether or not `info`'s kind has anything queued), or when its kind is a flood
        of its band: it asks for tokens at more than `FLOOD_X` x the mean rate of the other kinds of its band that
        asked within `idle_s` (gateway/askrates.py; with none, the headroom is lent: nobody is there to keep it
        for). A kind with nothing else of its own queued is held once it has asked `FLOOD_ASKS` times since it
        started asking and asks at `ALONE_X` x that bound: a flood's first requests must not take every free slot,
        and a steady tenant's rate crosses `FLOOD_X` now and then by chance. One with others queued is not held when
        a less urgent kind is queued (the headroom is kept from that one: its requests come after) or, with
        fairness, when another tenant of its band has more queued (that one is the flood: a light tenant's burst
        queued beside it is not held back as it is; the virtual token counters cannot tell them apart, the lift
        evens them)."""
        if not self.headroom:
            return 0
        priority = info.priority or 0
        kind = (info.tenant, priority)
        queued = self._kinds.get(kind, 0)
        if self._more_urgent_lately(priority):
            return self.headroom  # queued or not: a flood's first requests must not take a more urgent band's slots
        if queued <= 1:  # nothing else of its own queued: held only as a plain flood, once it has asked twice
            alone_x = self.FLOOD_X * self.ALONE_X
            return self.headroom if self._asks.outpaces(kind, self._clock(), alone_x, self.FLOOD_ASKS) else 0
        if priority < max(self._priorities):
            return 0
        if self.fair and len(self._waiting) > 1:
            tenant = info.tenant
            if any(n > queued for (t, p), n in self._kinds.items() if p == priority and t != tenant):
                return 0  # another tenant of its band has more queued: that one is the flood
        if not self._asks.outpaces(kind, self._clock(), self.FLOOD_X):
            return 0  # it asks for no more than the others of its band: a burst, queued because it was held
        return self.headroom

    def _ask(self, info: RequestInfo) -> None:
        """A new request of `info`'s kind asked for a slot, leased, queued or refused (counted with a headroom)."""
        if self.headroom:
            self._asks.ask((info.tenant, info.priority or 0), self._clock(), info.cost)

    def _more_urgent_lately(self, priority: int) -> bool:
        """Whether a more urgent priority than `priority` is queued, or asked for a slot within `idle_s`."""
        return (any(p < priority for p in self._priorities)
                or self._asks.asked_within(priority, self._clock(), self.idle_s))

    def leave(self, info: RequestInfo) -> None:
        """`info` leaves the queue: served, refused or gone."""
        tenant = info.tenant
        priority = info.priority or 0
        kind = (tenant, priority)
        count = self._kinds.get(kind, 0) - 1
        if count > 0:
            self._kinds[kind] = count
        else:
            self._kinds.pop(kind, None)
        count = self._priorities.get(priority, 0) - 1
        if count > 0:
            self._priorities[priority] = count
        else:
            self._priorities.pop(priority, None)
        waiting = self._waiting.get(tenant, 0) - 1
        if waiting > 0:
            self._waiting[tenant] = waiting
        else:
            self._waiting.pop(tenant, None)
            self._last = self.counters.get(tenant, self._last)

    def refused(self, info: RequestInfo) -> None:
        """`info` was refused a place in a full queue: it asked all the same. Uncounted, a flood refused at a full
        queue stopped asking seconds before its last request and was forgotten first; the light tenants it had
        flooded were remembered at their own rates, and the next tenant asking at 3 x theirs was held as a flood
        (bench.fairness_vllm runs 32, 33, 38 and 42: the priority case alone after a tenants' flood refused 70-156
        times, 37-46 requests 0.2-1.2 s in the gateway's queue; none where it was refused 0 times)."""
        self._ask(info)

    def charge(self, info: RequestInfo) -> None:
        """`info` got a lease: its tokens count as served to its tenant."""
        cost = info.cost
        if not self._waiting:  # nobody queued: a new request leased at once (else a waiter's, counted on arrival)
            self._ask(info)
        if self.fair:
            tenant = info.tenant
            self._set(tenant, self.counters.get(tenant, self._last) + cost)

    def refund(self, tenant: str, tokens: int) -> None:
        """`tokens` charged to `tenant` were not served after all (gateway/settlement.py)."""
        if self.fair and tokens and tenant in self.counters:
            self.counters[tenant] -= tokens

    def _set(self, tenant: str, value: float) -> None:
        counters = self.counters
        counters[tenant] = value
        counters.move_to_end(tenant)
        while len(counters) > self.MAX_TENANTS:
            for oldest in counters:  # the least recently charged tenant that is not waiting (waiting ones stay)
                if oldest not in self._waiting:
                    break
            else:
                return
            del counters[oldest]
