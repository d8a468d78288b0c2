"""Token accounting and admission: counters never go negative and always return to exactly zero."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import QueueConfig, ReplicaConfig
from gateway.errors import GatewayError
from gateway.parsing import RequestInfo
from gateway.policies import make_policy
from gateway.replicas import Lease
from gateway.router import Router


def router(n: int = 3, queue: QueueConfig | None = None, **caps: int) -> Router:
    r = Router(make_policy("least_outstanding_tokens"), queue or QueueConfig(),
               [ReplicaConfig(url=f"http://r{i}:8000", **caps) for i in range(n)])
    for replica in r.replicas.values():
        replica.healthy, replica.models = True, frozenset({"m"})
    return r


async def settle() -> None:
    """Let woken tasks run to their next wait."""
    for _ in range(5):
        await asyncio.sleep(0)


def info(prompt: int = 10, output: int = 20) -> RequestInfo:
    return RequestInfo("m", prompt, output, True)


# One event of a request's life: start, first token, k tokens, all its tokens (the answer in whole), end (done, failed or cancelled: all call release).
events = st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["start", "first", "tokens", "all", "end"]),
                            st.integers(0, 50)), max_size=200)


@settings(max_examples=300, deadline=None)
@given(events=events, prompts=st.lists(st.integers(0, 2000), min_size=8, max_size=8),
       outputs=st.lists(st.integers(0, 500), min_size=8, max_size=8))
def test_counters_never_negative_and_return_to_zero(events: list[tuple[int, str, int]], prompts: list[int],
                                                    outputs: list[int]) -> None:
    """Under any interleaving of starts, tokens, ends and repeated releases, counters stay >= 0 and end at 0."""
    r = router()
    leases: dict[int, Lease] = {}
    for request, event, count in events:
        lease = leases.get(request)
        if event == "start" and lease is None:
            lease = r.try_acquire(info(prompts[request], outputs[request]))
            assert lease is not None
            leases[request] = lease
        elif lease is not None and event == "first":
            lease.first_token()
        elif lease is not None and event == "tokens":
            lease.tokens(count)
        elif lease is not None and event == "all":
            lease.all_tokens()
        elif lease is not None and event == "end":
            lease.release()
        for replica in r.replicas.values():
            assert replica.outstanding >= 0 and replica.inflight >= 0
            assert 0 <= replica.prefill <= replica.outstanding  # the prefill backlog is part of the tokens
        assert sum(x.outstanding for x in r.replicas.values()) == sum(x.outstanding for x in leases.values())
    for lease in leases.values():
        lease.release()
        lease.release()  # exactly once, however often it is called
    assert all(x.outstanding == 0 and x.inflight == 0 and x.prefill == 0 for x in r.replicas.values())


def test_lease_counts_prompt_then_output_down() -> None:
    """The prompt part goes at the first token; output counts down; the rest goes at the end."""
    r = router(n=1)
    replica = next(iter(r.replicas.values()))
    lease = r.try_acquire(info(prompt=100, output=50))
    assert lease is not None and replica.outstanding == 150 and replica.inflight == 1 and replica.prefill == 100
    lease.first_token()
    assert replica.outstanding == 50 and replica.prefill == 0
    lease.tokens(20)
    assert replica.outstanding == 30
    lease.tokens(1000)  # never below the budget
    assert replica.outstanding == 0
    lease.release()
    assert replica.inflight == 0


def test_whole_answer_returns_its_output_budget_while_the_request_is_in_flight() -> None:
    """An answer that arrived whole gives back its output tokens at once; the request stays in flight until its end
    (the client may still be reading it)."""
    r = router(n=1)
    replica = next(iter(r.replicas.values()))
    lease = r.try_acquire(info(prompt=100, output=50))
    assert lease is not None
    lease.first_token()
    lease.tokens(5)
    lease.all_tokens()
    assert replica.outstanding == 0 and replica.inflight == 1
    lease.release()
    assert replica.outstanding == 0 and replica.inflight == 0


async def test_queue_waits_for_a_free_replica_in_fifo_order() -> None:
    """With every replica at its cap, requests queue and go, in order, to whichever frees first."""
    r = router(n=2, queue=QueueConfig(max_size=10, max_wait_s=5), max_requests=1)
    first = [r.try_acquire(info()) for _ in range(2)]
    assert all(first) and r.try_acquire(info()) is None
    waiting = [asyncio.create_task(r.acquire(info())) for _ in range(3)]
    await settle()
    assert r.queue_depth == 3
    first[1].release()  # type: ignore[union-attr]
    await settle()
    assert waiting[0].done() and not waiting[1].done()
    assert waiting[0].result().replica is first[1].replica  # type: ignore[union-attr]
    first[0].release()  # type: ignore[union-attr]
    await settle()
    assert waiting[1].done() and not waiting[2].done()
    waiting[2].cancel()
    await asyncio.gather(waiting[2], return_exceptions=True)
    assert r.queue_depth == 0
    for task in waiting[:2]:
        task.result().release()
    assert all(x.inflight == 0 and x.outstanding == 0 for x in r.replicas.values())


async def test_full_queue_and_long_wait_get_429_with_retry_after() -> None:
    """Beyond the queue's bound, or past its maximum wait, the answer is 429 with Retry-After."""
    r = router(n=1, queue=QueueConfig(max_size=1, max_wait_s=0.05), max_requests=1)
    held = r.try_acquire(info())
    waiter = asyncio.create_task(r.acquire(info()))
    await settle()
    with pytest.raises(GatewayError) as full:
        await r.acquire(info())
    assert full.value.status == 429 and "Retry-After" in full.value.headers
    with pytest.raises(GatewayError) as waited:
        await waiter
    assert waited.value.status == 429 and "waited" in waited.value.message
    assert r.queue_depth == 0
    held.release()  # type: ignore[union-attr]


async def test_no_queue_means_429_at_the_cap() -> None:
    """Without a queue, a request finding every replica at its cap is refused at once."""
    r = router(n=1, max_outstanding_tokens=100)
    held = r.try_acquire(info(prompt=50, output=40))
    with pytest.raises(GatewayError) as exc:
        await r.acquire(info(prompt=50, output=40))
    assert exc.value.status == 429
    held.first_token()  # type: ignore[union-attr]
    lease = await r.acquire(info(prompt=10, output=10))  # 40 + 20 <= 100 now
    lease.release()
    held.release()  # type: ignore[union-attr]


async def test_token_cap_frees_as_tokens_stream() -> None:
    """A replica capped in outstanding tokens admits a queued request as soon as streaming frees enough."""
    r = router(n=1, queue=QueueConfig(max_size=5, max_wait_s=5), max_outstanding_tokens=100)
    held = r.try_acquire(info(prompt=50, output=50))
    waiter = asyncio.create_task(r.acquire(info(prompt=30, output=30)))
    await settle()
    assert not waiter.done()
    held.first_token()  # type: ignore[union-attr]
    await settle()
    assert not waiter.done()  # 50 + 60 > 100
    held.tokens(10)  # type: ignore[union-attr]
    await settle()
    assert waiter.done()  # 40 + 60 <= 100
    waiter.result().release()
    held.release()  # type: ignore[union-attr]


async def test_cancelled_waiter_that_got_a_lease_gives_it_back() -> None:
    """A request cancelled in the same instant it was served does not leak its lease."""
    r = router(n=1, queue=QueueConfig(max_size=5, max_wait_s=5), max_requests=1)
    held = r.try_acquire(info())
    waiter = asyncio.create_task(r.acquire(info()))
    await settle()
    held.release()  # type: ignore[union-attr]  # serves the waiter...
    waiter.cancel()  # ...which is cancelled before it runs again
    await asyncio.gather(waiter, return_exceptions=True)
    replica = next(iter(r.replicas.values()))
    assert replica.inflight == 0 and replica.outstanding == 0


async def test_small_request_does_not_jump_a_blocked_one() -> None:
    """Under a token cap, a small queued request waits behind a larger one that does not fit yet."""
    r = router(n=1, queue=QueueConfig(max_size=5, max_wait_s=5), max_outstanding_tokens=100)
    held = r.try_acquire(info(prompt=30, output=30))
    big = asyncio.create_task(r.acquire(info(prompt=30, output=30)))
    await settle()
    small = asyncio.create_task(r.acquire(info(prompt=5, output=5)))
    await settle()
    assert not big.done() and not small.done()  # 60 + 10 would fit, but the small one is behind
    held.release()  # type: ignore[union-attr]
    await settle()
    assert big.done() and small.done()  # 60 + 10 <= 100: both go, in order
    big.result().release()
    small.result().release()
