"""Replicas of one GPU behind the gateway's real routing code, in virtual time.

The gateway's own pieces do the routing: `gateway.policies.make_policy` picks, `gateway.replicas.Lease` does the
token accounting, and `gateway.router.Router` holds the pool and, when replicas have caps, the admission queue
(`Router.acquire`, run unchanged on a virtual-time asyncio loop). The simulated engines stand in for vLLM.

Token accounting as the gateway sees it: a lease takes prompt + output budget when routed, drops the prompt at
the first token and counts the output down as tokens stream back. Here every request's streamed tokens are
reported to its lease in one call when it ends; while it runs, the tokens it has streamed so far (an O(1)
aggregate per engine) are taken off its replica's count around each `pick`, so the policy sees exactly what a
gateway relaying every SSE chunk would see at that instant, without a Python call per token.

Replicas are configured as `deploy` configures them from a plan: their batch cap (`max_num_seqs`) and their speed
(`speed_of`: what a profile of one replica alone measures), which `estimated_ttft` and `prefix_affinity` use.
Multi-turn chats (`run_conversations`) send each turn when the previous reply has ended plus a think time, with
the key and history a chat request gives the gateway, and the engines' prefix caches on.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from gateway.affinity import PREFIX_BYTES
from gateway.config import QueueConfig, ReplicaConfig
from gateway.errors import GatewayError
from gateway.fairqueue import QueueOrder
from gateway.parsing import RequestInfo
from gateway.policies import Policy, make_policy
from gateway.replicas import Lease, Replica
from gateway.router import Router
from gateway.speed import Speed
from gateway.tokens import BYTES_PER_TOKEN

from .clock import LoopClock, VirtualClock
from .engine import Engine, SimRequest
from .node import AnySpec, Node, NodeSpec
from .vloop import VirtualTimeLoop
from .workload import Conversation, RequestSpec, poisson_arrivals, sharegpt_like

MODEL = "sim-model"
T = TypeVar("T")


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
    prefix: int = 0  # the affinity key the gateway would derive (0: none)
    prefix_tokens: int = 0  # prompt tokens an earlier turn left in its replica's cache
    prefix_guessed: bool = False  # prefix_tokens is the gateway's guess for a completions head (RequestInfo)
    blocks: Sequence[int] | None = None  # the sequence's block hashes, for the engines' prefix caches
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache

    def info(self) -> RequestInfo:
        """What the gateway's parser would make of this request."""
        return RequestInfo(MODEL, self.prompt_tokens, self.output_tokens, True, self.prefix, self.prefix_tokens,
                           self.prefix_guessed)


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
    hit_rate: float = math.nan  # prefix-cache hits / prompt tokens looked up, over all engines (nan: caching off)

    def report(self) -> str:
        hits = "" if math.isnan(self.hit_rate) else f"; prefix-cache hit rate {self.hit_rate:.1%}"
        return (f"{self.completed}/{self.requests} completed ({self.rejected} rejected) in {self.duration_s:.0f} s "
                f"simulated: {self.tokens_s:,.0f} tok/s ({self.output_tokens_s:,.0f} output); TTFT p50 "
                f"{self.ttft_p50 * 1e3:.0f} ms p99 {self.ttft_p99 * 1e3:.0f} ms; e2e p50 {self.e2e_p50:.2f} s "
                f"p99 {self.e2e_p99:.2f} s; imbalance {self.imbalance:.2f}; preemptions {self.preemptions}{hits}")


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
    queries = sum(e.prefix_cache_queries for e in engines)
    hit_rate = sum(e.prefix_cache_hits for e in engines) / queries if queries else math.nan
    return Summary(len(records), len(done), sum(r.rejected for r in records), pct(ttft, 50), pct(ttft, 99),
                   pct(e2e, 50), pct(e2e, 99), (out + sum(r.prompt_tokens for r in done)) / span, out / span,
                   imbalance, span, sum(e.num_preemptions for e in engines),
                   tuple(float(c) / max(1, len(done)) for c in counts), hit_rate)


def speed_of(spec: NodeSpec, context: int = 512) -> Speed:
    """What a profile of one replica alone measures: decode step time by batch size (sequences of `context`
    tokens) and prefill tokens/s (the marginal cost of a full prefill step)."""
    from .steptime import StepTimeModel

    model = StepTimeModel(spec.model, spec.gpu, spec.cost)
    batches = sorted({1, 8, 16, 32, 64, 128, 256, spec.max_num_seqs})
    steps = tuple((b, model.host_s(b) + model.decode_s(b, context)) for b in batches)
    budget = max(spec.model.max_model_len, 2048)
    prefill = model.device_s(budget, 1, 0, budget * budget / 2) - model.device_s(1, 1, 0, 0)
    return Speed(steps, budget / prefill)


class Pinned:
    """The affinity oracle: a key's first request goes where `inner` picks, every later one to the same replica
    whatever its load (when it has room: under admission caps a full home is passed over)."""

    def __init__(self, inner: Policy) -> None:
        self._inner = inner
        self._homes: dict[int, str] = {}

    def pick(self, candidates: Sequence[Replica], info: RequestInfo) -> Replica:
        url = self._homes.get(info.prefix)
        for replica in candidates if url else ():
            if replica.url == url:
                return replica
        replica = self._inner.pick(candidates, info)
        if info.prefix and url is None:
            self._homes[info.prefix] = replica.url
        return replica


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

    def __init__(self, node: Node, policy: str | Policy, rng: random.Random, max_requests: int | None = None,
                 queue: QueueConfig | None = None, order: QueueOrder | None = None, given_speed: bool = True) -> None:
        self.node = node
        self.urls = [f"http://sim-replica-{i}" for i in range(len(node.engines))]
        self.engines = dict(zip(self.urls, node.engines))
        self.index = {url: i for i, url in enumerate(self.urls)}
        # given_speed False: the gateway's default speed, as `deploy up` configures replicas without a plan
        speed = node.spec.gateway_speed() if given_speed else None
        configs = [ReplicaConfig(url=u, max_requests=max_requests, max_num_seqs=node.spec.max_num_seqs, speed=speed)
                   for u in self.urls]
        chooser = make_policy(policy, rng) if isinstance(policy, str) else policy
        self.router = Router(StreamedTokens(chooser, self.engines), queue or QueueConfig(), configs, order=order)
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
            record.cached_tokens = req.cached_tokens
            lease.tokens(req.generated)
            lease.release()
            if on_done is not None and not on_done.done():
                on_done.set_result(None)

        engine.add(SimRequest(record.prompt_tokens, record.output_tokens, on_first_token=first, on_finish=finish,
                              blocks=record.blocks))


def capacity(spec: AnySpec, specs: Sequence[RequestSpec]) -> float:
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


def saturation_sample(spec: AnySpec, specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """Enough requests of the mix to keep every replica's batch full for a while."""
    n = max(2000, 8 * spec.replicas * spec.max_num_seqs)
    return [specs[i % len(specs)] for i in range(n)]


def run_open_loop(spec: AnySpec, n: int, load: float, policy: str, seed: int = 0,
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
        lease = gw.router.try_acquire(record.info())
        assert lease is not None, "replicas without caps always have room"
        gw.start(lease, record)
        if i + 1 < len(records):
            clock.call_at(records[i + 1].arrival, arrive, i + 1)

    clock.call_at(records[0].arrival, arrive, 0)
    clock.run()
    return summarize(records, gw.node.engines, gw.imbalance)


async def send(gw: Gateway, record: Record) -> None:
    """One request through `Router.acquire` (waiting in the admission queue if need be) until it ends."""
    gw.sample_balance()
    try:
        lease = await gw.router.acquire(record.info())
    except GatewayError:  # 429: the queue is full or the wait too long
        record.rejected = True
        return
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gw.start(lease, record, done)
    await done


async def _routed(spec: AnySpec, records: list[Record], policy: str | Policy, seed: int,
                  max_requests: int | None, queue: QueueConfig | None, given_speed: bool) -> Summary:
    loop = asyncio.get_running_loop()
    gw = Gateway(Node(spec, LoopClock(loop)), policy, random.Random(seed), max_requests, queue,
                 given_speed=given_speed)

    async def one(record: Record) -> None:
        await asyncio.sleep(record.arrival - loop.time())
        await send(gw, record)

    await asyncio.gather(*(one(r) for r in records))
    return summarize(records, gw.node.engines, gw.imbalance)


def run_routed(spec: AnySpec, specs: Sequence[RequestSpec], arrivals: np.ndarray, policy: str | Policy,
               seed: int = 0, max_requests: int | None = None, queue: QueueConfig | None = None,
               keys: str = "", records_out: list[Record] | None = None, given_speed: bool = True) -> Summary:
    """Arrivals through the gateway's `Router.acquire` (admission queue included) on a virtual-time loop.

    `keys`: give each request its own affinity key, as the gateway does for single-turn requests: "chat" (no
    history), or "completions" (a prompt longer than the keyed head, `PREFIX_BYTES`, counts that head as
    expected cached); "" for none. `records_out` gets the per-request records (to pool percentiles over seeds).
    `given_speed` False: the gateway keeps its default speed (as `deploy up` without a plan), not the replicas'.
    """
    rng = random.Random(seed)
    head = PREFIX_BYTES // BYTES_PER_TOKEN if keys == "completions" else 0
    records = [Record(float(t), s.prompt_tokens, s.output_tokens, prefix=rng.getrandbits(64) | 1 if keys else 0,
                      prefix_tokens=head if s.prompt_tokens > head else 0, prefix_guessed=keys == "completions")
               for t, s in zip(arrivals, specs)]
    if records_out is not None:
        records_out.extend(records)
    return on_virtual_loop(_routed(spec, records, policy, seed, max_requests, queue, given_speed))


def on_virtual_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


def conversation_records(conv: Conversation, block_size: int = 16) -> list[Record]:
    """One record per turn: the prompt (system, history, new message), the key and history a chat request gives
    the gateway, and the block hashes of the prompt and its reply (a prefix of the whole conversation's)."""
    hashes = conv.block_hashes(block_size)
    key = hash((1, conv.cid)) & ((1 << 64) - 1) | 1
    out = []
    for i, turn in enumerate(conv.turns):
        prompt = conv.prompt_tokens(i)
        out.append(Record(math.nan, prompt, turn.output_tokens, prefix=key, prefix_tokens=conv.history_tokens(i),
                          blocks=hashes[:(prompt + turn.output_tokens) // block_size]))
    return out


async def _conversations(spec: AnySpec, convs: Sequence[Conversation], policy: str | Policy, seed: int,
                         max_requests: int | None, queue: QueueConfig | None) -> tuple[Summary, list[Record]]:
    loop = asyncio.get_running_loop()
    node = Node(spec, LoopClock(loop))
    gw = Gateway(node, policy, random.Random(seed), max_requests, queue)
    records: list[Record] = []

    async def chat(conv: Conversation) -> None:
        due = conv.start
        for turn, record in zip(conv.turns, conversation_records(conv, node.engine_config.block_size)):
            due += turn.think_s
            await asyncio.sleep(due - loop.time())
            record.arrival = loop.time()
            records.append(record)
            await send(gw, record)
            if record.finished is None:
                return  # rejected: the user gives up on this chat
            due = record.finished

    await asyncio.gather(*(chat(c) for c in convs))
    return summarize(records, node.engines, gw.imbalance), records


def run_conversations(spec: AnySpec, convs: Sequence[Conversation], policy: str | Policy, seed: int = 0,
                      max_requests: int | None = None, queue: QueueConfig | None = None,
                      records_out: list[Record] | None = None) -> Summary:
    """Multi-turn chats through the gateway's router: each turn sent `think_s` after the previous reply ended."""
    if not spec.prefix_caching:
        raise ValueError("multi-turn runs need the engines' prefix caching (NodeSpec.prefix_caching)")
    loop = VirtualTimeLoop()
    try:
        summary, records = loop.run_until_complete(_conversations(spec, convs, policy, seed, max_requests, queue))
    finally:
        loop.close()
    if records_out is not None:
        records_out.extend(records)
    return summary
