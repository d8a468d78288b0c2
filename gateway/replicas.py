"""Replica state and the lease that accounts for one request's outstanding tokens.

A request's cost is its prompt tokens plus its output budget. The lease adds the cost to its replica when
taken, releases the prompt part at the first token, counts the output part down as tokens stream back, and
releases whatever remains when the request ends, fails or is cancelled: exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import ReplicaConfig
from .parsing import RequestInfo


class Replica:
    """One upstream vLLM server and its live load. Mutated only on the event loop."""

    __slots__ = ("url", "weight", "max_requests", "max_outstanding_tokens", "healthy", "models",
                 "outstanding", "inflight", "cards")

    def __init__(self, config: ReplicaConfig) -> None:
        self.url = config.url
        self.weight = config.weight
        self.max_requests = config.max_requests
        self.max_outstanding_tokens = config.max_outstanding_tokens
        self.healthy = False
        self.models: frozenset[str] = frozenset()
        self.cards: dict[str, dict[str, object]] = {}  # the replica's /v1/models entries, by model id
        self.outstanding = 0
        self.inflight = 0

    def load(self) -> float:
        """Outstanding tokens relative to capacity: what least-outstanding-tokens compares."""
        return self.outstanding / self.weight

    def has_room(self, cost: int) -> bool:
        """Whether admission caps let one more request of `cost` tokens in (an idle replica always takes one)."""
        if self.max_requests is not None and self.inflight >= self.max_requests:
            return False
        cap = self.max_outstanding_tokens
        return cap is None or self.outstanding == 0 or self.outstanding + cost <= cap

    def serves(self, model: str) -> bool:
        return not model or model in self.models

    def __repr__(self) -> str:
        return f"Replica({self.url!r}, healthy={self.healthy}, outstanding={self.outstanding}, inflight={self.inflight})"


class Lease:
    """One request's reservation on one replica."""

    __slots__ = ("replica", "_prompt", "_output", "_done", "_on_release")

    def __init__(self, replica: Replica, info: RequestInfo, on_release: Callable[[], None]) -> None:
        self.replica = replica
        self._prompt = info.prompt_tokens
        self._output = info.max_tokens
        self._done = False
        self._on_release = on_release
        replica.outstanding += self._prompt + self._output
        replica.inflight += 1

    @property
    def outstanding(self) -> int:
        return 0 if self._done else self._prompt + self._output

    def first_token(self) -> None:
        """Prefill is over: the prompt's tokens are no longer work to do."""
        if self._prompt and not self._done:
            self.replica.outstanding -= self._prompt
            self._prompt = 0
            if self.replica.max_outstanding_tokens is not None:
                self._on_release()  # only a token cap can admit a queued request now

    def tokens(self, count: int) -> None:
        """`count` output tokens came back; never counts down more than the budget."""
        if self._done:
            return
        done = min(count, self._output)
        if done:
            self._output -= done
            self.replica.outstanding -= done
            if self.replica.max_outstanding_tokens is not None:
                self._on_release()  # only a token cap can admit a queued request now

    def release(self) -> None:
        """The request is over, however it ended. Safe to call more than once."""
        if self._done:
            return
        self._done = True
        self.replica.outstanding -= self._prompt + self._output
        self.replica.inflight -= 1
        self._prompt = self._output = 0
        self._on_release()
