"""Per-tenant token rates: a token bucket per tenant, 429 with Retry-After when a request's tokens are not there.

A request costs its prompt tokens plus its output budget (what the gateway reserves on a replica; OpenAI's and
LiteLLM's tokens-per-minute limits count the same way); once its answer is in, the budget it did not use comes
back, and all of it when no replica answered (gateway/settlement.py). A bucket holds up to `burst` tokens and refills at
`tokens_per_s`; a request is let through when the bucket holds its cost (or, for a request larger than the burst,
a full bucket) and may leave it in debt, which later requests wait out. With several gateway workers each holds
its own buckets, so each worker's rate is the configured one divided by the workers.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .config import TenantsConfig
from .errors import GatewayError
from .parsing import RequestInfo
from .tenancy import key_tenant

BURST_S = 10.0  # a tenant's default burst: this many seconds of its rate


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    burst: float


class _Bucket:
    __slots__ = ("level", "stamp")

    def __init__(self, level: float, stamp: float) -> None:
        self.level = level
        self.stamp = stamp


class TokenRates:
    """Token buckets by tenant; `take` lets a request through or raises a 429 saying when to retry."""

    MAX_TENANTS = 65536  # buckets kept, least recently used out first (a forgotten one starts full)

    def __init__(self, config: TenantsConfig, workers: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._default = self._rate(config.tokens_per_s, config.burst, workers)
        self._by_tenant = {item.name or key_tenant(key): self._rate(item.tokens_per_s, item.burst, workers)
                           for key, item in config.keys if item.tokens_per_s is not None}
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def limited(self) -> bool:
        """Whether any tenant has a rate (else the gateway does not keep this object)."""
        return self._default is not None or bool(self._by_tenant)

    @staticmethod
    def _rate(tokens_per_s: float | None, burst: float | None, workers: int) -> Rate | None:
        if tokens_per_s is None:
            return None
        rate = tokens_per_s / workers
        return Rate(rate, (burst / workers) if burst is not None else rate * BURST_S)

    def rate_of(self, tenant: str) -> Rate | None:
        """The rate that applies to `tenant` (its key's, by the name the key gives it), else the default."""
        return self._by_tenant.get(tenant, self._default)

    def take(self, info: RequestInfo) -> None:
        """Take the request's tokens from its tenant's bucket, or raise 429 with Retry-After."""
        rate = self.rate_of(info.tenant)
        if rate is None:
            return
        now = self._clock()
        buckets = self._buckets
        bucket = buckets.get(info.tenant)
        if bucket is None:
            bucket = buckets[info.tenant] = _Bucket(rate.burst, now)
            if len(buckets) > self.MAX_TENANTS:
                buckets.popitem(last=False)
        else:
            buckets.move_to_end(info.tenant)
            bucket.level = min(rate.burst, bucket.level + (now - bucket.stamp) * rate.tokens_per_s)
            bucket.stamp = now
        cost = info.cost
        need = min(cost, rate.burst)
        if bucket.level < need:
            wait = math.ceil((need - bucket.level) / rate.tokens_per_s)
            raise GatewayError(429, f"this client's token rate ({rate.tokens_per_s:g} tokens/s, bursts of "
                               f"{rate.burst:g}) is used up: this request costs {cost} tokens (prompt + max_tokens); "
                               f"retry in {wait} s", code="rate_limit_exceeded",
                               headers={"Retry-After": str(max(1, wait))})
        bucket.level -= cost

    def refund(self, info: RequestInfo, tokens: int) -> None:
        """`tokens` of what `take` took for `info` were not served after all (gateway/settlement.py)."""
        rate = self.rate_of(info.tenant)
        bucket = self._buckets.get(info.tenant)
        if rate is not None and bucket is not None and tokens:
            bucket.level = min(rate.burst, bucket.level + tokens)
