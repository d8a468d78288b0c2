"""The simulator's adapter slots and load time, and adapter-aware against adapter-blind routing."""

from __future__ import annotations

import numpy as np

from bench.routing import spec
from sim.fleet import capacity, saturation_sample
from sim.lora import LoraSim, Slots, SlotStats, run_adapters
from sim.workload import mixed, poisson_arrivals


def test_slots_load_once_and_unload_the_least_recently_used_idle_adapter() -> None:
    """Two slots: a resident adapter is ready at once, a new one after the load; the LRU idle one goes."""
    stats = SlotStats()
    slots = Slots(2, 0.5, stats)
    assert slots.acquire("a", 0.0) == (0.5, None)
    assert slots.acquire("a", 0.1) == (0.5, None)  # the same load
    slots.release("a")
    slots.release("a")
    assert slots.acquire("b", 1.0) == (1.5, None)
    assert slots.acquire("a", 2.0) == (2.0, None)  # a is now the more recently used; b is busy
    slots.release("a")
    assert slots.acquire("c", 3.0) == (3.5, "a")  # b still has a request in flight: a goes
    assert (stats.loads, stats.unloads, stats.overflows) == (3, 1, 0)


def test_adapter_aware_routing_loads_far_less_than_adapter_blind() -> None:
    """16 adapters over 4 replicas of 4 slots at 80% load: aware routing loads adapters several times less often,
    with no worse median time to first token."""
    node = spec()
    rng = np.random.default_rng(0)
    specs = mixed(400, rng)
    arrivals = poisson_arrivals(400, 0.8 * capacity(node, saturation_sample(node, specs)), rng)
    aware, aware_stats = run_adapters(node, specs, arrivals, "prefix_affinity", LoraSim(), True)
    blind, blind_stats = run_adapters(node, specs, arrivals, "prefix_affinity", LoraSim(), False)
    assert aware.completed == blind.completed == 400
    assert aware_stats.loads * 2 < blind_stats.loads
    assert aware.ttft_p50 <= blind.ttft_p50 * 1.05
