"""Routing policies: each picks one replica among candidates that are healthy, serve the model and have room.

Callers never switch on a policy's class: they call `pick` and get a replica.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from .parsing import RequestInfo
from .replicas import Replica


class Policy(Protocol):
    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        """Choose one of `candidates` (never empty)."""
        ...


class RoundRobin:
    """Each replica in turn."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        self._next += 1
        return candidates[self._next % len(candidates)]


class Random:
    """A replica drawn uniformly at random."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        return self._rng.choice(candidates)


class _LeastBy:
    """The replica with the least of some load; ties go round the candidates so an idle pool shares work."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._offset = 0

    @staticmethod
    def key(replica: Replica) -> float:
        raise NotImplementedError

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        n = len(candidates)
        self._offset = (self._offset + 1) % n
        best = candidates[self._offset]
        best_key = self.key(best)
        for i in range(1, n):
            replica = candidates[(self._offset + i) % n]
            key = self.key(replica)
            if key < best_key:
                best, best_key = replica, key
        return best


class LeastOutstandingTokens(_LeastBy):
    """The replica with the fewest outstanding tokens relative to its capacity."""

    @staticmethod
    def key(replica: Replica) -> float:
        return replica.outstanding / replica.weight


class LeastRequests(_LeastBy):
    """The replica with the fewest in-flight requests relative to its capacity."""

    @staticmethod
    def key(replica: Replica) -> float:
        return replica.inflight / replica.weight


class PowerOfTwo:
    """Two replicas drawn at random; the one with fewer outstanding tokens (relative to capacity)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if a.outstanding / a.weight <= b.outstanding / b.weight else b


POLICIES: dict[str, type[RoundRobin] | type[Random] | type[LeastOutstandingTokens] | type[LeastRequests]
               | type[PowerOfTwo]] = {
    "least_outstanding_tokens": LeastOutstandingTokens,
    "round_robin": RoundRobin,
    "random": Random,
    "least_requests": LeastRequests,
    "power_of_two": PowerOfTwo,
}


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    """The policy called `name` (see POLICIES)."""
    return POLICIES[name](rng)
