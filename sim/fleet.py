"""Replicas of one GPU behind the gateway's real routing code, in virtual time.

The gateway's own pieces do the routing: `gateway.policies.make_policy` picks, `gateway.replicas.Lease` does the
token accounting, and `gateway.router.Router` holds the pool and, when replicas have caps, the admission queue
(`Router.acquire`, run unchanged on a virtual-time asyncio loop). The simulated engines stand in for vLLM.

Token accounting as the gateway sees it: a lease takes prompt + output budget when routed, drops the prompt at
the first token and counts the output down as tokens stream back. Here every request's streamed tokens are
reported to its lease in one call when it ends; while it runs, the tokens it has streamed so far (an O(1)
aggregate per engine) are taken off its replica's count around each `pick`, so the policy sees exactly what a
gateway relaying every SSE chunk would see at that instant, without a Python call per token.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.config import QueueConfig, ReplicaConfig
from gateway.errors import GatewayError
from gateway.parsing import RequestInfo
from gateway.policies import Policy, make_policy
from gateway.replicas import Lease, Replica
from gateway.router import Router

from .clock import LoopClock, VirtualClock
from .engine import Engine, SimRequest
from .node import Node, NodeSpec
from .vloop import VirtualTimeLoop
from .workload import RequestSpec, poisson_arrivals, sharegpt_like

MODEL = "sim-model"


@dataclass
class Record:
    """One request as a client of the gateway saw it."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    replica: int = -1
    first_token: float | None = None
    finished: float | None = None
    rejected: bool = False


@dataclass(frozen=True)
class Summary:
    """Latency percentiles (seconds), throughput and balance of one run."""

    requests: int
    completed: int
    rejected: int
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    tokens_s: float
    output_tokens_s: float
    imbalance: float  # mean over arrivals of max/mean outstanding tokens per replica (1.0: even)
    duration_s: float
    preemptions: int
    share: tuple[float, ...] = field(default=())  # fraction of requests each replica served

    def report(self) -> str:
        return (f"{self.completed}/{self.requests} completed ({self.rejected} rejected) in {self.duration_s:.0f} s "
                f"simulated: {self.tokens_s:,.0f} tok/s ({self.output_tokens_s:,.0f} output); TTFT p50 "
                f"{self.ttft_p50 * 1e3:.0f} ms p99 {self.ttft_p99 * 1e3:.0f} ms; e2e p50 {self.e2e_p50:.2f} s "
                f"p99 {self.e2e_p99:.2f} s; imbalance {self.imbalance:.2f}; preemptions {self.preemptions}")


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(records: Sequence[Record], engines: Sequence[Engine], imbalance: float) -> Summary:
    done = [r for r in records if r.finished is not None and r.first_token is not None]
    ttft = np.array([r.first_token - r.arrival for r in done])  # type: ignore[operator]
    e2e = np.array([r.finished - r.arrival for r in done])  # type: ignore[operator]
    start = min(r.arrival for r in records)
    end = max((r.finished for r in done), default=start)  # type: ignore[type-var]
    span = max(end - start, 1e-9)  # type: ignore[operator]
    out = sum(r.output_tokens for r in done)
    counts = np.bincount([r.replica for r in done], minlength=len(engines))
    return Summary(len(records), len(done), sum(r.rejected for r in records), pct(ttft, 50), pct(ttft, 99),
                   pct(e2e, 50), pct(e2e, 99), (out + sum(r.prompt_tokens for r in done)) / span, out / span,
                   imbalance, span, sum(e.num_preemptions for e in engines),
                   tuple(float(c) / max(1, len(done)) for c in counts))


class StreamedTokens:
    """A policy wrapper: the policy sees each replica's count net of the tokens already streamed back."""

    def __init__(self, inner: Policy, engines: dict[str, Engine]) -> None:
        self._inner = inner
        self._engines = engines

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        streamed = [self._engines[r.url].generated_inflight() for r in candidates]
        for replica, n in zip(candidates, streamed):
            replica.outstanding -= n
        try:
            return self._inner.pick(candidates, info)
        finally:
            for replica, n in zip(candidates, streamed):
                replica.outstanding += n


class Gateway:
    """The gateway's router over a node's engines (replica i is `http://sim-replica-i`)."""

    def __init__(self, node: Node, policy: str, rng: random.Random, max_requests: int | None = None,
                 queue: QueueConfig | None = None) -> None:
        self.node = node
        self.urls = [f"http://sim-replica-{i}" for i in range(len(node.engines))]
        self.engines = dict(zip(self.urls, node.engines))
        self.index = {url: i for i, url in enumerate(self.urls)}
        configs = [ReplicaConfig(url=u, max_requests=max_requests) for u in self.urls]
        self.router = Router(StreamedTokens(make_policy(policy, rng), self.engines), queue or QueueConfig(), configs)
        for replica in self.router.replicas.values():
            replica.healthy = True
            replica.models = frozenset({MODEL})
        self._imbalance_sum = 0.0
        self._imbalance_n = 0

    def sample_balance(self) -> None:
        """Record max/mean of the replicas' true outstanding tokens (skipped when all are idle)."""
        loads = [r.outstanding - self.engines[r.url].generated_inflight() for r in self.router.replicas.values()]
        mean = sum(loads) / len(loads)
        if mean > 0:
            self._imbalance_sum += max(loads) / mean
            self._imbalance_n += 1

    @property
    def imbalance(self) -> float:
        return self._imbalance_sum / self._imbalance_n if self._imbalance_n else 1.0

    def start(self, lease: Lease, record: Record, on_done: asyncio.Future[None] | None = None) -> None:
        """Send the request to the leased replica's engine; the lease follows its tokens."""
        engine = self.engines[lease.replica.url]
        record.replica = self.index[lease.replica.url]
        clock = self.node.clock

        def first(req: SimRequest) -> None:
            record.first_token = clock.now()
            lease.first_token()

        def finish(req: SimRequest) -> None:
            record.finished = clock.now()
            lease.tokens(req.generated)
            lease.release()
            if on_done is not None and not on_done.done():
                on_done.set_result(None)

        engine.add(SimRequest(record.prompt_tokens, record.output_tokens, on_first_token=first, on_finish=finish))


def capacity(spec: NodeSpec, specs: Sequence[RequestSpec]) -> float:
    """Requests/s the node sustains with this mix: all at t=0, split evenly, until the first replica runs dry.

    Measured as tokens (prompt + output) processed per second while every replica still had requests waiting,
    divided by the mix's mean tokens per request, so the mix's short requests finishing first do not inflate it.
    """
    clock = VirtualClock()
    node = Node(spec, clock)
    for i, s in enumerate(specs):
        node.engines[i % len(node.engines)].add(SimRequest(s.prompt_tokens, s.output_tokens))
    probe = _Drained(node.engines, clock)
    clock.call_at(0.0, probe.check)
    clock.run()
    tokens = probe.tokens_at_drain
    mean = sum(s.prompt_tokens + s.output_tokens for s in specs) / len(specs)
    return tokens / probe.drained_at / mean


class _Drained:
    """Polls (every 10 ms of simulated time) for the first replica with an empty waiting queue."""

    def __init__(self, engines: Sequence[Engine], clock: VirtualClock) -> None:
        self.engines, self.clock = engines, clock
        self.drained_at = 0.0
        self.tokens_at_drain = 0

    def check(self) -> None:
        if all(e.num_waiting for e in self.engines):
            self.clock.call_at(self.clock.now() + 0.01, self.check)
            return
        self.drained_at = self.clock.now()
        self.tokens_at_drain = sum(e.prompt_tokens_total + e.generation_tokens_total for e in self.engines)


def saturation_sample(spec: NodeSpec, specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """Enough requests of the mix to keep every replica's batch full for a while."""
    n = max(2000, 8 * spec.replicas * spec.max_num_seqs)
    return [specs[i % len(specs)] for i in range(n)]


def run_open_loop(spec: NodeSpec, n: int, load: float, policy: str, seed: int = 0,
                  specs: Sequence[RequestSpec] | None = None, arrivals: np.ndarray | None = None) -> Summary:
    """The fast path: Poisson arrivals at `load` x capacity, routed by `policy`, no admission queue."""
    rng = np.random.default_rng(seed)
    specs = list(specs) if specs is not None else sharegpt_like(n, rng)
    if arrivals is None:
        rate = load * capacity(spec, saturation_sample(spec, specs))
        arrivals = poisson_arrivals(n, rate, rng)
    clock = VirtualClock()
    gw = Gateway(Node(spec, clock), policy, random.Random(seed))
    records = [Record(float(t), s.prompt_tokens, s.output_tokens) for t, s in zip(arrivals, specs)]

    def arrive(i: int) -> None:
        record = records[i]
        gw.sample_balance()
        info = RequestInfo(MODEL, record.prompt_tokens, record.output_tokens, True)
        lease = gw.router.try_acquire(info)
        assert lease is not None, "replicas without caps always have room"
        gw.start(lease, record)
        if i + 1 < len(records):
            clock.call_at(records[i + 1].arrival, arrive, i + 1)

    clock.call_at(records[0].arrival, arrive, 0)
    clock.run()
    return summarize(records, gw.node.engines, gw.imbalance)


async def _routed(spec: NodeSpec, records: list[Record], policy: str, seed: int, max_requests: int | None,
                  queue: QueueConfig | None) -> Summary:
    loop = asyncio.get_running_loop()
    gw = Gateway(Node(spec, LoopClock(loop)), policy, random.Random(seed), max_requests, queue)

    async def one(record: Record) -> None:
        await asyncio.sleep(record.arrival - loop.time())
        gw.sample_balance()
        info = RequestInfo(MODEL, record.prompt_tokens, record.output_tokens, True)
        try:
            lease = await gw.router.acquire(info)
        except GatewayError:  # 429: the queue is full or the wait too long
            record.rejected = True
            return
        done: asyncio.Future[None] = loop.create_future()
        gw.start(lease, record, done)
        await done

    await asyncio.gather(*(one(r) for r in records))
    return summarize(records, gw.node.engines, gw.imbalance)


def run_routed(spec: NodeSpec, specs: Sequence[RequestSpec], arrivals: np.ndarray, policy: str, seed: int = 0,
               max_requests: int | None = None, queue: QueueConfig | None = None) -> Summary:
    """Arrivals through the gateway's `Router.acquire` (admission queue included) on a virtual-time loop."""
    records = [Record(float(t), s.prompt_tokens, s.output_tokens) for t, s in zip(arrivals, specs)]
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(_routed(spec, records, policy, seed, max_requests, queue))
    finally:
        loop.close()
