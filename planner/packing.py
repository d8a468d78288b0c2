"""Several models on one device: each model's replica count and batch cap, chosen by its traffic and its goal.

Pure: values in, values out. For one model at batch cap B with r replicas, each replica receives rate / r
requests/s and is modelled as B servers (vLLM's batch slots) of speed capacity(B) / B: an M/M/B queue, whose p99
wait (Erlang C) is added to the time to first token measured (or estimated) with the batch full. A model's
**headroom** is the largest factor its traffic can grow by while its predicted p99 TTFT stays within its goal
(without a TTFT goal: while its replicas keep up). `pack` gives every model an option (replicas, B) so that the
smallest headroom is as large as possible within the memory budget, then spends what is left where the headroom is
lowest. Nothing fits at the stated traffic: `PackingError`, naming the model(s) and by how much.

On a GPU the replicas also share the device's compute: each point carries the device-seconds one request costs
at that cap (`device_s`), and the traffic of all models together, times the common headroom, must not need more
than the device's time. Which option to take per model is then a two-budget choice; at each headroom level the
cheapest-memory options are taken, then swapped for ones that save device time per extra byte (a greedy heuristic,
not an exact knapsack).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.errors import PlannerError

GIB = 1024**3
_BISECT_STEPS = 60


class PackingError(PlannerError):
    """The models cannot all meet their goals at their traffic on this device; the message names them."""


@dataclass(frozen=True)
class Goal:
    """A model's latency goal (None: none stated)."""

    p99_ttft_ms: float | None = None
    p99_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("p99_ttft_ms", "p99_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PlannerError(f"{name} must be a positive number of milliseconds, got {value!r}")


@dataclass(frozen=True)
class SpeedPoint:
    """One batch cap of one model, in the terms of that model's traffic."""

    batch_size: int
    capacity_rps: float  # requests/s one replica sustains at this cap, at the traffic's lengths
    base_ttft_ms: float  # p99 time to first token with the batch full (no queueing in front of vLLM)
    replica_bytes: int  # one replica's memory slice at this cap
    tpot_ms: float | None = None  # p99 (else mean) time per output token at this cap
    device_s: float = 0.0  # device-seconds one request costs at this cap, besides its share of `step_device_s`
    step_device_s: float = 0.0  # device-seconds of one step whatever its batch (reading the weights)
    steps: int = 1  # steps per request: its output tokens (an embedding: one pass)
    step_s: float = 0.0  # one step's wall time at this cap (for how full the batch runs at a given rate)

    def device_per_request(self, replicas: int, rate: float) -> float:
        """Device-seconds per request at `rate` over `replicas`: a step's fixed cost is shared by the requests
        in it, about rate / replicas x their time in the replica (Little), at most the cap."""
        if self.step_device_s <= 0:
            return self.device_s
        batch = min(self.batch_size, max(1.0, rate / replicas * self.steps * self.step_s))
        return self.device_s + self.steps * self.step_device_s / batch


@dataclass(frozen=True)
class Demand:
    """One model's traffic, goal and speed points: what packing needs to know about it."""

    name: str
    rate: float  # requests/s expected
    goal: Goal
    points: tuple[SpeedPoint, ...]
    max_replicas: int = 8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise PlannerError(f"model {self.name!r}: traffic must be a positive number of requests/s, "
                               f"got {self.rate!r}")
        if not self.points:
            raise PlannerError(f"model {self.name!r} has no speed points (an empty profile?)")


@dataclass(frozen=True)
class Option:
    """One way to serve a model: `replicas` replicas capped at `batch_size`, and what that gives."""

    name: str
    replicas: int
    point: SpeedPoint
    headroom: float  # how many times its traffic it carries within its goal
    p99_ttft_ms: float  # predicted at the stated traffic (inf: it cannot keep up)
    device_s: float = 0.0  # device-seconds per request at the stated traffic

    @property
    def memory_bytes(self) -> int:
        return self.replicas * self.point.replica_bytes

    @property
    def batch_size(self) -> int:
        return self.point.batch_size


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with `offered` = arrival rate / one server's rate."""
    if offered >= servers:
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):  # Erlang B by its recurrence: stable for hundreds of servers
        blocking = offered * blocking / (k + offered * blocking)
    rho = offered / servers
    return blocking / (1 - rho * (1 - blocking))


def p99_ttft_ms(point: SpeedPoint, replicas: int, rate: float) -> float:
    """Predicted p99 TTFT at `rate` requests/s spread over `replicas` replicas (inf: they cannot keep up)."""
    per_replica = rate / replicas
    if per_replica >= point.capacity_rps:
        return math.inf
    slot_rate = point.capacity_rps / point.batch_size
    waiting = erlang_c(point.batch_size, per_replica / slot_rate)
    wait_s = 0.0 if waiting <= 0.01 else math.log(100 * waiting) / (point.capacity_rps - per_replica)
    return point.base_ttft_ms + 1000 * wait_s


def headroom(point: SpeedPoint, replicas: int, rate: float, goal: Goal) -> float:
    """The largest factor on `rate` that keeps the goal (0: not even a trickle of traffic meets it)."""
    saturation = replicas * point.capacity_rps / rate
    if goal.p99_tpot_ms is not None and (point.tpot_ms is None or point.tpot_ms > goal.p99_tpot_ms):
        return 0.0
    if goal.p99_ttft_ms is None:
        return saturation
    if point.base_ttft_ms > goal.p99_ttft_ms:
        return 0.0
    low, high = 0.0, saturation
    for _ in range(_BISECT_STEPS):
        mid = (low + high) / 2
        if p99_ttft_ms(point, replicas, mid * rate) <= goal.p99_ttft_ms:
            low = mid
        else:
            high = mid
    return low


def options(demand: Demand) -> list[Option]:
    """Every (replicas, batch cap) for the model that carries any of its traffic, cheapest memory first."""
    found = []
    for point in demand.points:
        for replicas in range(1, demand.max_replicas + 1):
            room = headroom(point, replicas, demand.rate, demand.goal)
            if room > 0:
                found.append(Option(demand.name, replicas, point, room, p99_ttft_ms(point, replicas, demand.rate),
                                    point.device_per_request(replicas, demand.rate)))
    return sorted(found, key=lambda o: (o.memory_bytes, -o.headroom))


def _cheapest(choices: Sequence[Option], at_least: float) -> Option | None:
    return next((o for o in choices if o.headroom >= at_least), None)  # `choices` is cheapest first


@dataclass(frozen=True)
class Packing:
    """The chosen option per model (in the demands' order), the budget, and the common headroom it reached."""

    chosen: tuple[Option, ...]
    budget_bytes: int
    min_headroom: float
    device_load: float = 0.0  # share of the device's time the stated traffic needs

    @property
    def used_bytes(self) -> int:
        return sum(o.memory_bytes for o in self.chosen)


def device_load(chosen: Sequence[Option], rates: dict[str, float]) -> float:
    """The share of the device's time the stated traffic needs with these options."""
    return sum(rates[o.name] * o.device_s for o in chosen)


def _select(demands: Sequence[Demand], table: dict[str, list[Option]], level: float, budget: int,
            rates: dict[str, float]) -> list[Option] | None:
    """Options with at least `level` headroom that fit both budgets at that level, or None.

    Start from each model's cheapest-memory option; while the device's time is short, take the swap that saves
    the most device time per extra byte and still fits the memory.
    """
    eligible = [[o for o in table[d.name] if o.headroom >= level] for d in demands]
    if not all(eligible):
        return None
    picked = [min(choices, key=lambda o: (o.memory_bytes, o.device_s)) for choices in eligible]
    while True:
        used = sum(o.memory_bytes for o in picked)
        if used > budget:
            return None
        if level * device_load(picked, rates) <= 1:
            return picked
        best: tuple[float, int, Option] | None = None
        for i, choices in enumerate(eligible):
            now = picked[i]
            for o in choices:
                saved = rates[o.name] * (now.device_s - o.device_s)
                extra = o.memory_bytes - now.memory_bytes
                if saved > 0 and used + extra <= budget:
                    worth = saved / max(extra, 1)
                    if best is None or worth > best[0]:
                        best = (worth, i, o)
        if best is None:
            return None
        picked[best[1]] = best[2]


def pack(demands: Sequence[Demand], budget_bytes: int) -> Packing:
    """Max-min headroom within the budget, then the leftover memory to whichever model has the least headroom."""
    names = [d.name for d in demands]
    if len(set(names)) != len(names):
        raise PlannerError(f"model names must be unique, got {names}")
    table = {d.name: options(d) for d in demands}
    _check_each(demands, table, budget_bytes)
    rates = {d.name: d.rate for d in demands}
    levels = sorted({1.0} | {o.headroom for choices in table.values() for o in choices})
    best: list[Option] | None = None
    for level in reversed(levels):  # the greedy choice is not monotone in the level: scan from the top
        best = _select(demands, table, level, budget_bytes, rates)
        if best is not None:
            break
    if best is None or common_headroom(best, rates) < 1:
        raise PackingError(_short_message(demands, table, budget_bytes, best, rates))
    best = _spend_leftover(best, table, budget_bytes, rates)
    return Packing(tuple(best), budget_bytes, common_headroom(best, rates), device_load(best, rates))


def common_headroom(chosen: Sequence[Option], rates: dict[str, float]) -> float:
    """The smallest headroom, the device's compute counted: every model's traffic grows together."""
    load = device_load(chosen, rates)
    return min(min(o.headroom for o in chosen), 1 / load if load > 0 else math.inf)


def _spend_leftover(chosen: list[Option], table: dict[str, list[Option]], budget: int,
                    rates: dict[str, float]) -> list[Option]:
    """Upgrade the model with the least headroom while memory is left and the device's time allows; a model that
    cannot grow is set aside."""
    chosen, fixed = list(chosen), set[str]()
    while len(fixed) < len(chosen):
        i = min((k for k in range(len(chosen)) if chosen[k].name not in fixed), key=lambda k: chosen[k].headroom)
        current = chosen[i]
        free = budget - sum(o.memory_bytes for o in chosen) + current.memory_bytes
        floor = common_headroom(chosen, rates)
        better = [o for o in table[current.name] if o.headroom > current.headroom * 1.0001 and o.memory_bytes <= free
                  and common_headroom([*chosen[:i], o, *chosen[i + 1:]], rates) >= floor]
        if better:
            chosen[i] = min(better, key=lambda o: (o.memory_bytes, -o.headroom))
        else:
            fixed.add(current.name)
    return chosen


def _check_each(demands: Sequence[Demand], table: dict[str, list[Option]], budget: int) -> None:
    """A model that cannot meet its goal even alone on the device: name it and what it reaches."""
    for demand in demands:
        alone = [o for o in table[demand.name] if o.memory_bytes <= budget]
        goal = _goal_text(demand.goal)
        if not table[demand.name]:
            fastest = min(demand.points, key=lambda p: p.base_ttft_ms)
            raise PackingError(f"model {demand.name!r} cannot meet {goal} at any batch cap: its lowest p99 TTFT "
                               f"with the batch full is {fastest.base_ttft_ms:.0f} ms (B={fastest.batch_size})"
                               + _tpot_note(demand))
        if not alone:
            smallest = min(p.replica_bytes for p in demand.points)
            raise PackingError(f"model {demand.name!r}: not one replica fits ({_gib(smallest)} GiB at its smallest "
                               f"batch cap, {_gib(budget)} GiB usable) while meeting {goal}")
        rates = {demand.name: demand.rate}
        top = max(alone, key=lambda o: common_headroom([o], rates))
        if common_headroom([top], rates) < 1:
            room = common_headroom([top], rates)
            raise PackingError(
                f"model {demand.name!r} cannot meet {goal} at {demand.rate:g} requests/s even alone on the device: "
                f"its best ({top.replicas} replica(s) at B={top.batch_size}) carries {room:.2f} x that "
                f"traffic, {room * demand.rate:.3g} requests/s; lower its traffic, relax its goal or "
                "give it a bigger device")


def _short_message(demands: Sequence[Demand], table: dict[str, list[Option]], budget: int,
                   best: list[Option] | None, rates: dict[str, float]) -> str:
    needs = [_cheapest(table[d.name], 1.0) for d in demands]
    assert all(needs)  # _check_each: every model meets its goal alone
    needs_ = [o for o in needs if o is not None]
    scale = common_headroom(best, rates) if best else 0.0
    tail = (f" Together they fit at {scale:.2f} x the stated traffic. Lower a model's traffic, relax a goal, move a "
            "model elsewhere, or use a bigger device")
    total = sum(o.memory_bytes for o in needs_)
    if total > budget:
        parts = ", ".join(f"{o.name} {_gib(o.memory_bytes)} GiB ({o.replicas} x B={o.batch_size})"
                          for o in sorted(needs_, key=lambda o: -o.memory_bytes))
        largest = max(needs_, key=lambda o: o.memory_bytes)
        return (f"the device cannot carry every model at its traffic and goal: they need {_gib(total)} GiB "
                f"({parts}) but {_gib(budget)} GiB are usable, {_gib(total - budget)} GiB short; the largest need "
                f"is {largest.name!r}." + tail)
    fastest = [min((o for o in table[d.name] if o.headroom >= 1), key=lambda o: o.device_s) for d in demands]
    load = device_load(fastest, rates)
    parts = ", ".join(f"{o.name} {rates[o.name] * o.device_s:.2f}" for o in
                      sorted(fastest, key=lambda o: -rates[o.name] * o.device_s))
    largest = max(fastest, key=lambda o: rates[o.name] * o.device_s)
    return (f"the device's compute cannot carry every model at its traffic: the traffic needs at least {load:.2f} x "
            f"the device's time ({parts}), {load - 1:.2f} x too much" if load > 1 else
            "memory and the device's time do not both fit at once") + \
        f"; the largest need is {largest.name!r}." + tail


def _tpot_note(demand: Demand) -> str:
    if demand.goal.p99_tpot_ms is None:
        return ""
    known = [p.tpot_ms for p in demand.points if p.tpot_ms is not None]
    return f", and its lowest TPOT is {min(known):.1f} ms" if known else ", and its profile has no TPOT"


def _goal_text(goal: Goal) -> str:
    parts = [f"p99 TTFT {goal.p99_ttft_ms:g} ms" if goal.p99_ttft_ms else "",
             f"p99 TPOT {goal.p99_tpot_ms:g} ms" if goal.p99_tpot_ms else ""]
    return " and ".join(p for p in parts if p) or "its traffic (no latency goal)"


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"
