"""Routing policies: each picks one replica among candidates that are healthy, serve the model and have room.

Callers never switch on a policy's class: they call `pick` and get a replica.

`estimated_ttft` keeps outstanding tokens as its load measure and adds what tokens miss. It estimates each
candidate's time to first token from the replica's outstanding tokens, split into prompt tokens not yet started
(its prefill backlog) and output tokens still to come, its requests in flight, its batch cap (vLLM's
max_num_seqs; else its admission cap max_requests) and its speed (decode step time by batch size and prefill
tokens/s, from the planner's profile; gateway/speed.py):

    ttft = (prefill backlog + prompt) / prefill tokens/s + step(inflight + 1)           a free batch slot
    ttft = (prefill backlog + prompt) / prefill tokens/s
           + step(cap) x (1 + (inflight - cap + 1) x (output tokens outstanding / inflight) / cap)   none

With a free batch slot the new request is prefilled at the next step: only the prompts ahead of it and the step
count. With every slot taken it first waits for enough running requests to finish, which the output tokens ahead
decide. Replicas whose estimate is within half again the best (plus one lone decode step) are eligible, and of
those the one with the fewest outstanding tokens wins. Picking the lowest estimate outright was measured worse at
95% load (docs/routing.md): it keeps each request's own wait short but unbalances the batches, and the run's
throughput, hence its queue, suffers; balancing tokens among the near-best keeps both.

`prefix_affinity` (the default) adds prefix-cache affinity. Requests with the same prefix key (gateway/affinity.py)
rank the candidates in the same rendezvous-hash order. A request with history (a later turn: its home is expected
to hold that many prompt tokens) goes to the first in that order whose estimate, less the prefill its cache saves,
is within the eligibility bound plus the best estimate x the share of the prompt expected cached, and whose
outstanding tokens exceed the least loaded eligible replica's by at most 8 x the cached tokens (bounded load); the
overflow thus also goes to one place, the next in rank. A chat's first turn follows the same rule as if a fifth of
its prompt were cached (`FIRST_TURN_WEIGHT`), with nothing subtracted: its next turn will look for this prompt at
its home, so the first turn goes there unless that is clearly busier (placing first turns by load moved a
conversation at its second turn whenever its first had gone elsewhere). A completions prompt's key is only its
first KiB, a guess: the policy keeps a bounded set of the heads it has seen (`SEEN_KEYS`), and a head seen for the
first time, almost always a unique prompt, is routed as `estimated_ttft` routes it; a recurring head goes home as a
later turn does (measured on vLLM-CPU: trusting every head put long unique prompts on their first choice under a
2,048-token slack, and the default's p99 TTFT was the worst of four policies). Requests without a key are routed
as `estimated_ttft` routes them.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from .affinity import key_hash, rank
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


class EstimatedTtft:
    """The fewest outstanding tokens among the replicas whose estimated time to first token is near the best."""

    SLACK_STEPS = 1.0  # replicas within this many lone decode steps of the best estimate are eligible ...
    SLACK_RATIO = 0.5  # ... or within this fraction of it (a queue of seconds makes milliseconds irrelevant)

    def __init__(self, rng: random.Random | None = None) -> None:
        self._offset = 0

    @staticmethod
    def estimate(replica: Replica, prompt_tokens: int) -> float:
        """Seconds until a new request of `prompt_tokens` would get its first token on `replica`."""
        speed = replica.speed
        n = replica.inflight
        cap = replica.max_num_seqs or replica.max_requests
        seconds = (replica.prefill + prompt_tokens) / speed.prefill_tokens_s
        if cap is not None and n >= cap:  # no free batch slot: wait for n - cap + 1 requests to finish
            output = replica.outstanding - replica.prefill
            seconds += speed.step(cap) * (1 + (n - cap + 1) * output / (n * cap))
        else:
            seconds += speed.table[n + 1] if n < 1000 else speed.step(n + 1)
        return seconds / replica.weight

    def bound(self, best: float, replica: Replica) -> float:
        """The estimate a replica may have and still be eligible, when the best candidate's is `best`."""
        return best * (1 + self.SLACK_RATIO) + replica.speed.table[1] * self.SLACK_STEPS / replica.weight

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        n = len(candidates)
        self._offset = offset = (self._offset + 1) % n  # ties go round the candidates so an idle pool shares work
        return self.choose([*candidates[offset:], *candidates[:offset]] if offset else candidates, info)

    def choose(self, ordered: Sequence[Replica], info: RequestInfo, margin: float = 0.0) -> Replica:
        """The fewest outstanding tokens among the eligible; the earliest in `ordered` within `margin` of that."""
        estimate, prompt = self.estimate, info.prompt_tokens
        estimates = [estimate(r, prompt) for r in ordered]
        best = min(estimates)
        eligible = [r for r, t in zip(ordered, estimates) if t <= self.bound(best, r)]
        if len(eligible) == 1:
            return eligible[0]
        loads = [r.outstanding / r.weight for r in eligible]
        least = min(loads) + margin
        return next(r for r, load in zip(eligible, loads) if load <= least)


class PrefixAffinity(EstimatedTtft):
    """Requests sharing a prefix key go to its first rendezvous choice while that is near the best estimate."""

    HISTORY_RATIO = 1.0  # a prompt all history may go where its estimate is up to (1.5 + this) x the best
    HISTORY_TOKENS = 8.0  # ... and while its outstanding tokens exceed the least loaded's by at most this x cached
    FIRST_TURN_WEIGHT = 0.2  # a first turn goes home as a later turn would with this share of its prompt cached

    SEEN_KEYS = 65536  # completions heads remembered: a guessed prefix counts once its key has been seen

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._salts: dict[str, int] = {}
        self._seen: OrderedDict[int, None] = OrderedDict()

    def _recurs(self, prefix: int) -> bool:
        """Whether this process saw `prefix` recently (and remember it either way, least recent out first)."""
        seen = self._seen
        if prefix in seen:
            seen.move_to_end(prefix)
            return True
        seen[prefix] = None
        if len(seen) > self.SEEN_KEYS:
            seen.popitem(last=False)
        return False

    def _salt(self, url: str) -> int:
        salt = self._salts.get(url)
        if salt is None:
            salt = self._salts[url] = key_hash(url.encode())
        return salt

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        prefix = info.prefix
        if not prefix or len(candidates) == 1:
            return super().pick(candidates, info)
        if info.prefix_guessed and not self._recurs(prefix):
            return super().pick(candidates, info)  # a completions head seen for the first time: likely unique
        ranked = sorted(candidates, key=lambda r: rank(prefix, self._salt(r.url)), reverse=True)
        if info.prefix_tokens:  # a later turn: its home holds the history; that saves its prefill there
            cached = min(info.prefix_tokens, info.prompt_tokens)
            return self._home(ranked, info, cached, cached)
        # A first turn: nothing cached yet, but the next turn will reuse this prompt where this one runs.
        return self._home(ranked, info, int(info.prompt_tokens * self.FIRST_TURN_WEIGHT), 0)

    def _home(self, ranked: Sequence[Replica], info: RequestInfo, worth: int, saved: int) -> Replica:
        """The first in rank order whose estimate (less the `saved` prefill) is near the best and whose load is
        within `worth` x HISTORY_TOKENS of the least loaded eligible replica's."""
        estimates = [self.estimate(r, info.prompt_tokens) for r in ranked]
        home = ranked[0]
        estimates[0] -= saved / home.speed.prefill_tokens_s / home.weight  # its cache saves that prefill
        best = min(estimates)
        extra = best * self.HISTORY_RATIO * worth / max(1, info.prompt_tokens)  # the more cached, the more worth
        eligible = [r for r, t in zip(ranked, estimates) if t <= self.bound(best, r) + extra]
        least = min(r.outstanding / r.weight for r in eligible) + worth * self.HISTORY_TOKENS
        return next(r for r in eligible if r.outstanding / r.weight <= least)


class ConsistentHash(EstimatedTtft):
    """A request with a prefix key always goes to the key's rendezvous first choice, whatever its load: every turn
    of a conversation on one replica (the sticky oracle the benchmarks hold `prefix_affinity` against; vLLM's
    router and nginx's `hash` offer the same). Requests without a key are routed as `estimated_ttft` routes them."""

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._salts: dict[str, int] = {}

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        prefix = info.prefix
        if not prefix or len(candidates) == 1:
            return super().pick(candidates, info)
        salts = self._salts
        for r in candidates:
            if r.url not in salts:
                salts[r.url] = key_hash(r.url.encode())
        return max(candidates, key=lambda r: rank(prefix, salts[r.url]))


POLICIES: dict[str, Callable[[random.Random | None], Policy]] = {
    "prefix_affinity": PrefixAffinity,
    "estimated_ttft": EstimatedTtft,
    "least_outstanding_tokens": LeastOutstandingTokens,
    "round_robin": RoundRobin,
    "random": Random,
    "least_requests": LeastRequests,
    "power_of_two": PowerOfTwo,
    "consistent_hash": ConsistentHash,
}


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    """The policy called `name` (see POLICIES)."""
    return POLICIES[name](rng)
