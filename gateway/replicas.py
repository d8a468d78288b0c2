"""Replica state and the lease that accounts for one request's outstanding tokens.

A request's cost is its prompt tokens plus its output budget. The lease adds the cost to its replica when
taken, releases the prompt part at the first token, counts the output part down as tokens stream back, and
releases whatever remains when the request ends, fails or is cancelled: exactly once. The prompt part is also
counted on its own (`prefill`: prompt tokens not yet started), the prefill backlog `estimated_ttft` needs.

With several worker processes (gateway/table.py) a replica's counters are columns of the shared load table:
a lease writes this process's own cells (`Replica.own`), and `Replica.refresh()`, called for every candidate of
a pick, sums each column over every worker's row into the plain attributes policies read (`outstanding`,
`inflight`, `prefill`). A replica not bound to a table (one process, a simulation, a test) keeps plain numbers only.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import ReplicaConfig
from .parsing import RequestInfo
from .speed import DEFAULT_SPEED
from .table import COLUMNS, INFLIGHT, OUTSTANDING, PREFILL, R_EJECTIONS, S_HEALTH_GEN, LoadTable


class Replica:
    """One upstream vLLM server and its live load. Mutated only on the event loop."""

    __slots__ = ("url", "weight", "max_requests", "max_outstanding_tokens", "healthy", "models",
                 "outstanding", "inflight", "cards", "draining", "own", "_columns", "_table", "_row", "_slot",
                 "prefill", "max_num_seqs", "speed")

    def __init__(self, config: ReplicaConfig) -> None:
        self.url = config.url
        self.weight = config.weight
        self.max_requests = config.max_requests
        self.max_outstanding_tokens = config.max_outstanding_tokens
        self.healthy = False
        self.draining = False  # no new requests; the control plane removes it once its requests are done
        self.models: frozenset[str] = frozenset()
        self.cards: dict[str, dict[str, object]] = {}  # the replica's /v1/models entries, by model id
        self.outstanding = 0  # gateway-wide, as of the last refresh, plus this process's changes since
        self.inflight = 0
        self.prefill = 0  # prompt tokens of requests that have no first token yet (part of `outstanding`)
        self.max_num_seqs = config.max_num_seqs  # vLLM's batch cap: configured, or read from its /metrics
        self.speed = config.speed or DEFAULT_SPEED
        self.own: list[int] | memoryview[int] = [0] * len(COLUMNS)  # this process's cells: the only ones it writes
        self._columns: tuple[memoryview, ...] = ()  # bound: the table's columns, in COLUMNS order
        self._table: LoadTable | None = None
        self._row = self._slot = 0

    def bind(self, table: LoadTable, row: int, slot: int, hi: int) -> None:
        """Keep the counters in `table`: this process writes row `row`, reads sum rows [0, hi)."""
        start = table.counter(row, slot)
        self.own = table.cells[start:start + len(COLUMNS)]
        self._columns = tuple(table.column(slot, i, hi) for i in range(len(COLUMNS)))
        self._table, self._row, self._slot = table, row, slot
        self.refresh()

    @property
    def slot(self) -> int:
        """The replica's slot in the load table (-1: not bound to one)."""
        return self._slot if self._table is not None else -1

    @property
    def table(self) -> LoadTable | None:
        return self._table

    def refresh(self) -> None:
        """Sum every worker's cells (and the load feedback's) into the attributes a policy compares."""
        columns = self._columns
        if columns:  # spelled out, not a loop over COLUMNS with setattr: this runs for every candidate of a pick
            self.outstanding = sum(columns[OUTSTANDING])
            self.inflight = sum(columns[INFLIGHT])
            self.prefill = sum(columns[PREFILL])

    def mark_ejected(self) -> None:
        """Tell the other workers that this one saw the replica fail (until its next good probe)."""
        table = self._table
        if table is not None:
            table.cells[table.ejection(self._row, self._slot)] = table.cells[table.slot_cell(self._slot, S_HEALTH_GEN)]
            table.cells[table.head_cell(self._row, R_EJECTIONS)] += 1

    def load(self) -> float:
        """Outstanding tokens relative to capacity: what least-outstanding-tokens compares."""
        return self.outstanding / self.weight

    def has_room(self, cost: int, reserve: int = 0) -> bool:
        """Whether admission caps let one more request of `cost` tokens in (an idle replica always takes one),
        leaving `reserve` of its `max_requests` free (the queue's headroom, gateway/fairqueue.py)."""
        cap = self.max_requests
        if cap is not None and self.inflight >= (cap - reserve if reserve < cap else 1):
            return False
        cap = self.max_outstanding_tokens
        if cap is None:
            return True
        outstanding = self.outstanding
        return outstanding == 0 or outstanding + cost <= cap

    def serves(self, model: str) -> bool:
        return not model or model in self.models

    def __repr__(self) -> str:
        return f"Replica({self.url!r}, healthy={self.healthy}, outstanding={self.outstanding}, inflight={self.inflight})"


class Lease:
    """One request's reservation on one replica."""

    __slots__ = ("replica", "_prompt", "_output", "_done", "_on_release", "counted", "charged")

    def __init__(self, replica: Replica, info: RequestInfo, on_release: Callable[[], None]) -> None:
        self.replica = replica
        self._prompt = info.prompt_tokens
        self._output = info.max_tokens
        self._done = False
        self._on_release = on_release
        self.counted = 0  # output tokens `tokens` was told of (beyond the budget too; `all_tokens` counts none)
        self.charged = False  # its cost was charged to its tenant's virtual token counter (gateway/fairqueue.py)
        cost = self._prompt + self._output
        replica.outstanding += cost
        replica.inflight += 1
        replica.prefill += self._prompt
        own = replica.own
        own[OUTSTANDING] += cost
        own[INFLIGHT] += 1
        own[PREFILL] += self._prompt

    @property
    def outstanding(self) -> int:
        return 0 if self._done else self._prompt + self._output

    def first_token(self) -> None:
        """Prefill is over: the prompt's tokens are no longer work to do."""
        if self._prompt and not self._done:
            replica = self.replica
            replica.outstanding -= self._prompt
            replica.prefill -= self._prompt
            own = replica.own
            own[OUTSTANDING] -= self._prompt
            own[PREFILL] -= self._prompt
            self._prompt = 0
            if replica.max_outstanding_tokens is not None:
                self._on_release()  # only a token cap can admit a queued request now

    def tokens(self, count: int) -> None:
        """`count` output tokens came back; never counts down more than the budget."""
        if self._done:
            return
        self.counted += count
        self._count_down(count)

    def all_tokens(self) -> None:
        """The replica's answer is complete: what is left of the output budget comes back at once (no counting)."""
        if not self._done:
            self._count_down(self._output)

    def _count_down(self, count: int) -> None:
        done = min(count, self._output)
        if done:
            self._output -= done
            replica = self.replica
            replica.outstanding -= done
            replica.own[OUTSTANDING] -= done
            if replica.max_outstanding_tokens is not None:
                self._on_release()  # only a token cap can admit a queued request now

    def release(self) -> None:
        """The request is over, however it ended. Safe to call more than once."""
        if self._done:
            return
        self._done = True
        replica = self.replica
        rest = self._prompt + self._output
        replica.outstanding -= rest
        replica.inflight -= 1
        replica.prefill -= self._prompt
        own = replica.own
        own[OUTSTANDING] -= rest
        own[INFLIGHT] -= 1
        own[PREFILL] -= self._prompt
        self._prompt = self._output = 0
        self._on_release()
