"""What a tenant is charged, corrected to what it was served, once a request's answer is in.

At admission a request is charged its prompt tokens plus its whole output budget (`max_tokens`): in its tenant's
virtual token counter (gateway/fairqueue.py, each lease) and in its tenant's token bucket (gateway/ratelimit.py,
once). The gateway cannot know the output in advance; it knows it afterwards. So, built only when fairness or token
rates are configured:

- a lease whose replica answered gives back the output budget it did not use: the counter then counts the tokens
  served, as the Virtual Token Counter does, and a client that asks for `max_tokens` 4096 and gets 50 tokens is not
  charged as if it got 4096;
- a lease that failed before any answer (the request was retried elsewhere) gives back all it was charged;
- a request's bucket gets back the budget its answer did not use, or all it took when it got no answer from a
  replica (refused by the gateway: no replica, the queue's 429; or the client went away first).

The tokens served: for a streamed answer, its events as the load accounting counts them (the `[DONE]` event
included: a token or two more than the answer's `usage`); for a whole answer, its `usage.completion_tokens` (none:
the whole budget).
"""

from __future__ import annotations

import msgspec

from .fairqueue import PriorityOrder, QueueOrder
from .parsing import RequestInfo
from .ratelimit import TokenRates


class _Usage(msgspec.Struct):
    completion_tokens: int = -1


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_ANSWER = msgspec.json.Decoder(_Answer)


def completion_tokens(body: bytes) -> int | None:
    """An OpenAI-style answer's `usage.completion_tokens`, or None where it has none (or is not JSON)."""
    try:
        usage = _ANSWER.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return usage.completion_tokens if usage is not None and usage.completion_tokens >= 0 else None


class Settlement:
    """Gives back what was charged at admission and not served."""

    def __init__(self, order: PriorityOrder | None, rates: TokenRates | None) -> None:
        self._order = order if order is not None and order.fair else None
        self._rates = rates

    @classmethod
    def of(cls, order: QueueOrder | None, rates: TokenRates | None) -> Settlement | None:
        """The settlement for the router's queue order and the token rates, or None where neither charges."""
        fair = order if isinstance(order, PriorityOrder) and order.fair else None
        return cls(fair, rates) if fair is not None or rates is not None else None

    @staticmethod
    def _unused(info: RequestInfo, served: int | None) -> int:
        """What `served` output tokens leave of the charge (None: nothing was served, all of it)."""
        if served is None:
            return info.cost
        return max(0, info.max_tokens - served)

    def lease_done(self, info: RequestInfo, served: int | None) -> None:
        """One lease of `info` is over: its replica served `served` output tokens, or (None) failed first."""
        if self._order is not None:
            self._order.refund(info.tenant, self._unused(info, served))

    def request_done(self, info: RequestInfo, served: int | None) -> None:
        """`info` is over: its answer held `served` output tokens, or (None) it got no answer from a replica."""
        if self._rates is not None:
            self._rates.refund(info, self._unused(info, served))
