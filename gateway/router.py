"""Choose a replica and reserve its tokens in one synchronous step; queue when every candidate is at its cap.

`acquire` filters to healthy replicas that serve the model and have room, asks the policy, and takes a lease,
with no `await` in between: on one event loop that is atomic, so no lock is needed. When every candidate is at
its cap, the request waits in one bounded FIFO queue and goes to whichever replica frees first.

Each candidate's counters are refreshed (summed over every worker's row of the load table) as the pick reads
them. With several workers each has its own queue; a release in another worker is seen by polling every
`QUEUE_POLL_S` while requests wait.

With a queue order (gateway/fairqueue.py: priorities, fairness between tenants) waiters are served in its order
instead of by arrival, and a full queue gives a newcomer of a more urgent priority the place of the least urgent,
latest waiter (which gets the 429). Without one (the default) nothing of that runs.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .config import QueueConfig, ReplicaConfig
from .errors import GatewayError
from .fairqueue import QueueOrder
from .parsing import RequestInfo, not_found
from .policies import Policy
from .replicas import Lease, Replica

QUEUE_POLL_S = 0.01  # while requests wait: how often to look for room freed by other workers or the feedback

MakeLease = Callable[[Replica], Lease]  # a lease of the caller's kind on a replica it chose (acquire_on)


@dataclass(eq=False)  # compared by identity: a waiter is one request
class _Waiter:
    info: RequestInfo
    exclude: frozenset[str]
    future: asyncio.Future[Lease]
    seq: int = 0
    on: Replica | None = None  # the replica the caller chose (acquire_on), else the policy picks
    make: MakeLease | None = None

    @property
    def kind(self) -> tuple[str, frozenset[str], str]:
        """Waiters of one kind find room, or none, alike (`wake` skips the rest of a kind that found none)."""
        return self.info.model, self.exclude, "" if self.on is None else self.on.url

    @property
    def group(self) -> tuple[str, int, tuple[str, frozenset[str], str]]:
        """Waiters that a queue order ranks by arrival among themselves: one tenant, priority and kind (the order's
        key is the same but for `seq`, and the headroom it reserves is the tenant's and priority's)."""
        return self.info.tenant, self.info.priority or 0, self.kind


def _last(group: dict[int, _Waiter]) -> _Waiter:
    """A group's latest waiter (groups keep arrival order)."""
    return next(reversed(group.values()))


class Router:
    """The replica pool, the routing policy, and the admission queue."""

    def __init__(self, policy: Policy, queue: QueueConfig, replicas: Iterable[ReplicaConfig] = (), *,
                 model_policies: Mapping[str, Policy] | None = None,
                 model_queues: Mapping[str, QueueConfig] | None = None,
                 order: QueueOrder | None = None) -> None:
        self.policy = policy
        self.queue = queue
        # Several models behind one gateway: a model may have its own policy and its own queue bound and wait,
        # so one model's burst cannot fill the queue that another model's requests wait in.
        self.model_policies = dict(model_policies or {})
        self.model_queues = dict(model_queues or {})
        self.order = order
        self._seq = 0
        self.replicas: dict[str, Replica] = {}
        self._waiters: dict[int, _Waiter] = {}  # by seq: in arrival order, removed in O(1)
        # with an order: the same waiters by group, each in arrival order; wake looks only at each group's first
        self._groups: dict[tuple[str, int, tuple[str, frozenset[str], str]], dict[int, _Waiter]] = {}
        self._poll: asyncio.TimerHandle | None = None
        for config in replicas:
            self.add(config)

    # -- the pool -------------------------------------------------------------------------------------------
    def add(self, config: ReplicaConfig) -> Replica:
        replica = self.replicas.get(config.url)
        if replica is None:
            replica = self.replicas[config.url] = Replica(config)
        return replica

    def remove(self, url: str) -> None:
        """Forget a replica; requests already on it finish and release into the detached object."""
        self.replicas.pop(url, None)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def models(self) -> set[str]:
        return {m for r in self.replicas.values() if r.healthy for m in r.models}

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    # -- choosing -------------------------------------------------------------------------------------------
    def _candidates(self, info: RequestInfo, exclude: frozenset[str]) -> list[Replica]:
        """The healthy replicas serving the model, not draining or excluded, each refreshed as it is found (one pass:
        this runs for every request)."""
        model = info.model
        candidates = []
        for replica in self.replicas.values():
            if replica.healthy and not replica.draining and (not model or model in replica.models) \
                    and replica.url not in exclude:
                replica.refresh()
                candidates.append(replica)
        return candidates

    def check_model(self, model: str) -> None:
        """404 for a model no replica lists, once some replica is healthy to say so (until then routing answers 503)."""
        for replica in self.replicas.values():
            if model in replica.models:
                return
        if any(r.healthy for r in self.replicas.values()):
            raise not_found(model)

    def _no_candidate(self, info: RequestInfo, exclude: frozenset[str]) -> GatewayError:
        known = any(info.model in r.models for r in self.replicas.values())
        if info.model and not known and any(r.healthy for r in self.replicas.values()):
            return not_found(info.model)
        what = f" for model `{info.model}`" if info.model else ""
        reason = "every replica failed" if exclude else "no healthy replica"
        return GatewayError(503, f"{reason}{what}; try again shortly", code="no_replica_available",
                            headers={"Retry-After": "1"})

    def try_acquire(self, info: RequestInfo, exclude: frozenset[str] = frozenset(), on: Replica | None = None,
                    make: MakeLease | None = None) -> Lease | None:
        """A lease on a replica with room now, or None when every candidate is at its cap (`on`, `make`: see
        `acquire_on`)."""
        cost = info.cost
        order = self.order
        reserve = 0 if order is None else order.reserve(info)
        if on is not None:
            if not on.healthy or on.draining:
                raise GatewayError(503, f"replica {on.url} is no longer serving; try again shortly",
                                   code="no_replica_available", headers={"Retry-After": "1"})
            on.refresh()
            if not on.has_room(cost, reserve):
                return None
            lease = make(on) if make is not None else Lease(on, info, self.wake)
        else:
            candidates = self._candidates(info, exclude)
            if not candidates:
                raise self._no_candidate(info, exclude)
            open_ = [r for r in candidates if r.has_room(cost, reserve)]
            if not open_:
                return None
            lease = Lease(self.model_policies.get(info.model, self.policy).pick(open_, info), info, self.wake)
        if order is not None:
            order.charge(info)
            lease.charged = True
        return lease

    def lease_now(self, info: RequestInfo, exclude: frozenset[str] = frozenset(), on: Replica | None = None,
                  make: MakeLease | None = None) -> Lease | None:
        """A lease at once when nobody is queued and a replica has room (the common case; no coroutine), else None."""
        return None if self._waiters else self.try_acquire(info, exclude, on, make)

    async def acquire_on(self, replica: Replica, info: RequestInfo, make: MakeLease) -> Lease:
        """A lease on `replica`, which the caller chose (a LoRA adapter's: gateway/lora.py), made by `make`: at once
        where it has room and nobody waits, else in the admission queue, in its order (priority, fairness) among
        the other waiters, until `replica` has room."""
        return await self.acquire(info, on=replica, make=make)

    async def acquire(self, info: RequestInfo, exclude: frozenset[str] = frozenset(), *, on: Replica | None = None,
                      make: MakeLease | None = None) -> Lease:
        """A lease, waiting in the admission queue if need be; 429 when the queue is full or waited too long."""
        lease = self.lease_now(info, exclude, on, make)  # FIFO: only when nobody is queued
        if lease is not None:
            return lease
        if self._waiters and on is None and not self._candidates(info, exclude):
            raise self._no_candidate(info, exclude)
        model: str | None = info.model
        queue = self.model_queues.get(info.model)
        if queue is None:
            queue, model, waiting = self.queue, None, len(self._waiters)
        else:
            waiting = sum(1 for w in self._waiters.values() if w.info.model == info.model)
        if waiting >= queue.max_size and not self._displace(info, model):
            if self.order is not None:
                self.order.refused(info)
            reason = "every replica is at its cap" + (" and the queue is full" if queue.max_size else "")
            raise GatewayError(429, f"{reason}; retry later", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
        self._seq += 1
        waiter = _Waiter(info, exclude, asyncio.get_running_loop().create_future(), self._seq, on, make)
        self._waiters[waiter.seq] = waiter
        if self.order is not None:
            self._groups.setdefault(waiter.group, {})[waiter.seq] = waiter
            self.order.arrive(info)
        self.wake()  # a replica may have room for it already (the queue's head waits for another model)
        self._poll_soon()
        try:
            await asyncio.wait((waiter.future,), timeout=queue.max_wait_s)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()  # a lease, or the GatewayError _wake set
        self._abandon(waiter)
        raise GatewayError(429, f"waited {queue.max_wait_s:g} s in the admission queue; retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": str(math.ceil(queue.max_wait_s))})

    def _displace(self, info: RequestInfo, model: str | None = None) -> bool:
        """With an order, make room for `info` by refusing a waiter (one of `model`'s when that model has a queue of
        its own): the least urgent, latest one if it is less urgent than `info`; else, with fairness, the latest of
        the tenant with the most queued in `info`'s band if that is at least two more than `info`'s tenant has (a
        flood cannot fill the queue and lock the other tenants out: longest-queue drop)."""
        if self.order is None:
            return False
        groups = [(g, w) for g, w in self._groups.items() if model is None or g[2][0] == model]
        if not groups:
            return False
        priority = info.priority or 0
        (_, worst_priority, _), worst = max(groups, key=lambda gw: (gw[0][1], _last(gw[1]).seq))
        if worst_priority > priority:
            return self._refuse(_last(worst), "a more urgent request took this one's place")
        if not self.order.fair:
            return False
        queued: dict[str, int] = {}
        for (tenant, p, _), waiters in groups:
            if p == priority:
                queued[tenant] = queued.get(tenant, 0) + len(waiters)
        if not queued:
            return False
        flood = max(queued, key=queued.__getitem__)
        if flood == info.tenant or queued[flood] <= queued.get(info.tenant, 0) + 1:
            return False
        latest = max((_last(w) for (tenant, p, _), w in groups if tenant == flood and p == priority),
                     key=lambda w: w.seq)
        return self._refuse(latest, "a tenant with fewer queued took this one's place")

    def _refuse(self, waiter: _Waiter, why: str) -> bool:
        """Refuse a waiter (429) to make room in a full queue."""
        if waiter.future.done():
            return False
        waiter.future.set_exception(GatewayError(
            429, f"the admission queue is full and {why}; retry later", code="rate_limit_exceeded",
            headers={"Retry-After": "1"}))
        self._leave(waiter)
        return True

    def _leave(self, waiter: _Waiter) -> None:
        del self._waiters[waiter.seq]
        if self.order is not None:
            group = self._groups[waiter.group]
            del group[waiter.seq]
            if not group:
                del self._groups[waiter.group]
            self.order.leave(waiter.info)

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiter gave up: leave the queue, or give back a lease that reached it meanwhile."""
        if not waiter.future.done():
            waiter.future.cancel()
            self._leave(waiter)
        elif waiter.future.exception() is None:
            waiter.future.result().release()

    def _poll_soon(self) -> None:
        if self._poll is None and self._waiters:
            self._poll = asyncio.get_running_loop().call_later(QUEUE_POLL_S, self._poll_now)

    def _poll_now(self) -> None:
        self._poll = None
        self.wake()
        self._poll_soon()

    def close(self) -> None:
        """Stop polling for queued requests."""
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None

    def wake(self) -> None:
        """Serve queued requests, in order, that a replica now has room for.

        Once a waiter finds no room, later waiters for the same model and exclusions are skipped in this pass:
        they would find none either, or (smaller, under a token cap) would jump the queue.
        """
        if not self._waiters:
            return
        if self.order is not None:
            self._wake_ordered(self.order)
            return
        served = []
        blocked: set[tuple[str, frozenset[str], str]] = set()
        for waiter in self._waiters.values():
            key = waiter.kind
            if waiter.future.done():
                served.append(waiter)
                continue
            if key in blocked:
                continue
            try:
                lease = self.try_acquire(waiter.info, waiter.exclude, waiter.on, waiter.make)
            except GatewayError as exc:
                waiter.future.set_exception(exc)
                served.append(waiter)
                continue
            if lease is None:
                blocked.add(key)
            else:
                waiter.future.set_result(lease)
                served.append(waiter)
        for waiter in served:
            del self._waiters[waiter.seq]

    def _wake_ordered(self, order: QueueOrder) -> None:
        """`wake` in the order's order, asked afresh after each lease (a lease changes its tenant's place).

        Within a group (`_Waiter.group`) the order's key differs only by arrival, so the best waiter is the best of
        the groups' first waiters: each pass costs the number of groups, not of waiters (a flood queues thousands).
        """
        blocked: set[tuple[tuple[str, frozenset[str], str], int]] = set()  # one kept out of the headroom blocks its kind
        while True:
            best, best_key = None, None
            for group in self._groups.values():  # a settled waiter has left its group (_leave)
                waiter = next(iter(group.values()))
                if (waiter.kind, order.reserve(waiter.info)) in blocked:
                    continue
                key = order.key(waiter.info, waiter.seq)
                if best_key is None or key < best_key:
                    best, best_key = waiter, key
            if best is None:
                return
            try:
                lease = self.try_acquire(best.info, best.exclude, best.on, best.make)
            except GatewayError as exc:
                best.future.set_exception(exc)
                self._leave(best)
                continue
            if lease is None:
                blocked.add((best.kind, order.reserve(best.info)))
            else:
                best.future.set_result(lease)
                self._leave(best)
