"""LoRA adapter slots and load time on the simulated replicas: adapter-aware routing against adapter-blind.

Each replica holds at most `max_loras` adapters. A request for an adapter its replica does not hold waits for a
load (`load_s`: reading the adapter and copying it to the device) before it reaches the engine; the least recently
used adapter with no request in flight makes room (when every slot is busy the load goes ahead anyway, over the
cap, and is counted as an overflow: the real gateway would wait instead). Concurrent requests for an adapter being
loaded wait for that one load.

- adapter-aware: the gateway's own `AdapterRouter.choose` (gateway/lora.py): a replica holding the adapter while
  it is within the load bound of the best, else the best;
- adapter-blind: the policy alone, as if every replica had every adapter registered (vLLM swapping them itself).

Not modelled: vLLM's batch-level LoRA budget (at most `max_loras` distinct adapters in one batch) and the slower
LoRA kernels; both cost adapter-blind routing more, so the comparison is, if anything, kind to it.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from gateway.config import AdapterSpec, LoraConfig
from gateway.lora import AdapterRouter, SharedHoldings
from gateway.metrics import CounterStore
from gateway.replicas import Lease
from gateway.table import LoadTable

from .clock import LoopClock
from .fleet import Gateway, Record, Summary, on_virtual_loop, summarize
from .node import AnySpec, Node
from .workload import RequestSpec


@dataclass(frozen=True)
class LoraSim:
    """The adapters and the replicas' slots."""

    adapters: int = 16
    zipf_s: float = 1.0
    max_loras: int = 4
    load_s: float = 0.2

    def names(self) -> tuple[str, ...]:
        return tuple(f"lora{i}" for i in range(self.adapters))

    def draw(self, n: int, rng: np.random.Generator) -> list[str]:
        """n adapter names, the k-th with probability proportional to 1 / k^s."""
        weights = 1.0 / np.arange(1, self.adapters + 1) ** self.zipf_s
        picks = rng.choice(self.adapters, size=n, p=weights / weights.sum())
        names = self.names()
        return [names[int(i)] for i in picks]


@dataclass
class SlotStats:
    loads: int = 0
    unloads: int = 0
    overflows: int = 0


class Slots:
    """One replica's adapters: resident in LRU order, requests in flight on each, loads under way."""

    def __init__(self, max_loras: int, load_s: float, stats: SlotStats) -> None:
        self.max_loras, self.load_s, self.stats = max_loras, load_s, stats
        self.resident: OrderedDict[str, float] = OrderedDict()  # name -> when it is (or was) ready
        self.inflight: Counter[str] = Counter()

    def acquire(self, name: str, now: float) -> tuple[float, str | None]:
        """When `name` is ready for a request arriving `now`, and the adapter unloaded for it (if any)."""
        self.inflight[name] += 1
        if name in self.resident:
            self.resident.move_to_end(name)
            return max(now, self.resident[name]), None
        victim = None
        if len(self.resident) >= self.max_loras:
            victim = next((n for n in self.resident if self.inflight[n] == 0), None)
            if victim is None:
                self.stats.overflows += 1
            else:
                del self.resident[victim]
                self.stats.unloads += 1
        self.stats.loads += 1
        self.resident[name] = now + self.load_s
        return now + self.load_s, victim

    def release(self, name: str) -> None:
        self.inflight[name] -= 1


async def _run(spec: AnySpec, records: list[Record], names: list[str], policy: str, seed: int, lora: LoraSim,
               aware: bool, stats: SlotStats) -> Summary:
    loop = asyncio.get_running_loop()
    gw = Gateway(Node(spec, LoopClock(loop)), policy, random.Random(seed))
    slots = {url: Slots(lora.max_loras, lora.load_s, stats) for url in gw.urls}
    table = LoadTable.create(rows=2)
    store = CounterStore(table.metric_region(1))
    holdings = SharedHoldings(store, lambda: [table.metric_region(r) for r in range(table.hi)])
    config = LoraConfig(adapters=tuple(AdapterSpec(n, f"/sim/{n}") for n in lora.names()), max_loras=lora.max_loras)
    adapters = AdapterRouter(config, gw.router, gw.router.policy, api=None,  # type: ignore[arg-type]
                             holdings=holdings, store=store)
    adapters.load_s = lora.load_s

    async def one(record: Record, name: str) -> None:
        await asyncio.sleep(record.arrival - loop.time())
        gw.sample_balance()
        info = record.info()
        if aware:
            replica = adapters.choose(config.registry()[name], replace(info, model=name))
            lease = Lease(replica, info, gw.router.wake)
        else:
            blind = gw.router.try_acquire(info)
            assert blind is not None, "replicas without caps always have room"
            lease = blind
        url = lease.replica.url
        ready, victim = slots[url].acquire(name, loop.time())
        if victim is not None:
            holdings.set_held(url, victim, False, 1 + loop.time())
        holdings.set_held(url, name, True, 1 + loop.time())
        if ready > loop.time():
            await asyncio.sleep(ready - loop.time())
        done: asyncio.Future[None] = loop.create_future()
        gw.start(lease, record, done)
        await done
        slots[url].release(name)

    await asyncio.gather(*(one(r, n) for r, n in zip(records, names)))
    return summarize(records, gw.node.engines, gw.imbalance)


def run_adapters(spec: AnySpec, specs: Sequence[RequestSpec], arrivals: np.ndarray, policy: str, lora: LoraSim,
                 aware: bool, seed: int = 0) -> tuple[Summary, SlotStats]:
    """One run: each request names an adapter (Zipf), routed adapter-aware or adapter-blind."""
    names = lora.draw(len(specs), np.random.default_rng([seed, 7]))
    records = [Record(float(t), s.prompt_tokens, s.output_tokens) for t, s in zip(arrivals, specs)]
    stats = SlotStats()
    summary = on_virtual_loop(_run(spec, records, names, policy, seed, lora, aware, stats))
    return summary, stats
