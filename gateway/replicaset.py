"""The replica set: written in one place (the control plane), followed by every worker through the load table.

`ReplicaSet` is the only writer. It gives each replica URL a slot of the table (stable for as long as the replica
is known, and kept for a removed one until no worker counts anything on it, so a request still finishing there
never writes into another replica's cells), and publishes the set (URLs, weights, caps, model cards, draining) as
a JSON blob, and health as slot cells. Every runtime change goes through it: DNS discovery, health probes, a
config reload on SIGHUP, and an admin API (issue #13) alike. With N workers it lives in the supervisor; with one,
in the gateway's own process.

`Follower` (one per worker) keeps a `Router`'s replicas equal to the published set: it checks one version number
every `FOLLOW_S` and rebuilds only what changed. Health is published healthy AND not ejected by any worker since
the replica's last good probe, so a replica one worker saw fail leaves every worker's candidates at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import ReplicaConfig
from .replicas import Replica
from .router import Router
from .table import (
    COLUMNS,
    H_BLOB_SEQ,
    INFLIGHT,
    R_HEARTBEAT,
    R_QUEUE,
    S_HEALTH_GEN,
    S_HEALTHY,
    LoadTable,
    TableError,
)

logger = logging.getLogger(__name__)

FOLLOW_S = 0.025  # how often a worker looks for changes to the replica set (one integer read when none)


@dataclass
class Entry:
    """One replica as the control plane knows it."""

    config: ReplicaConfig
    slot: int
    healthy: bool = False
    draining: bool = False
    cards: dict[str, dict[str, object]] = field(default_factory=dict)
    batch_cap: int | None = None  # max_num_seqs read from the replica's metrics (when the config gives none)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self.cards)


class ReplicaSet:
    """The replicas, their slots and their health: the one place runtime changes are made."""

    def __init__(self, table: LoadTable, worker_rows: range, on_change: Callable[[], None] | None = None) -> None:
        self.table = table
        self.worker_rows = worker_rows
        self.replicas: dict[str, Entry] = {}
        self._retired: dict[int, str] = {}  # slot -> URL of a removed replica some worker still counts on
        self._on_change = on_change

    # -- changes ------------------------------------------------------------------------------------------------
    def add(self, config: ReplicaConfig) -> Entry:
        """Add a replica, or update a known one's weight and caps; taken back from draining if it was."""
        entry = self.replicas.get(config.url)
        if entry is not None:
            if entry.config != config or entry.draining:
                entry.config, entry.draining = config, False
                self.publish()
            return entry
        slot = next((s for s, url in self._retired.items() if url == config.url), None)
        if slot is not None:
            del self._retired[slot]
        else:
            slot = self._free_slot()
            self.table.clear_slot(slot)
            self.table.cells[self.table.slot_cell(slot, S_HEALTH_GEN)] = 1
        entry = self.replicas[config.url] = Entry(config, slot)
        self.publish()
        return entry

    def remove(self, url: str) -> None:
        """Forget a replica; requests already on it finish, and its slot is reused only once they have."""
        entry = self.replicas.pop(url, None)
        if entry is not None:
            self.table.cells[self.table.slot_cell(entry.slot, S_HEALTHY)] = 0
            self._retired[entry.slot] = url
            self.publish()

    def drain(self, url: str) -> bool:
        """Send a replica no new requests, and remove it once its requests are done; False if unknown."""
        entry = self.replicas.get(url)
        if entry is None:
            return False
        if not entry.draining:
            entry.draining = True
            self.publish()
        return True

    def set_health(self, entry: Entry, ok: bool, cards: dict[str, dict[str, object]] | None = None) -> None:
        """A probe's result: healthy or not, and the replica's model cards when they were fetched."""
        table = self.table
        if self.replicas.get(entry.url) is not entry:
            return  # removed while the probe was in flight
        if ok != entry.healthy:
            logger.info("replica %s is %s", entry.url, "healthy" if ok else "unhealthy")
        changed = ok != entry.healthy or (ok and table.ejected(entry.slot))
        entry.healthy = ok
        table.cells[table.slot_cell(entry.slot, S_HEALTHY)] = int(ok)
        if ok:
            table.cells[table.slot_cell(entry.slot, S_HEALTH_GEN)] += 1  # ejections before this probe lapse
        if cards is not None and cards != entry.cards:
            entry.cards = cards
            self.publish()
        elif changed:
            table.touch()
            self._changed()

    def set_batch_cap(self, entry: Entry, cap: int | None) -> None:
        """The replica's max_num_seqs as its metrics give it (None: they do not)."""
        if cap is not None and cap != entry.batch_cap and self.replicas.get(entry.url) is entry:
            entry.batch_cap = cap
            self.publish()

    def reap(self) -> None:
        """Free the slots no worker counts on any more; remove drained replicas whose requests are done."""
        for slot in [s for s in self._retired if self._idle(s)]:
            del self._retired[slot]
        for entry in [e for e in self.replicas.values() if e.draining and self._idle(e.slot)]:
            logger.info("replica %s drained: removing it", entry.url)
            self.remove(entry.url)

    # -- reading ------------------------------------------------------------------------------------------------
    def own_load(self, slot: int) -> tuple[int, int]:
        """Outstanding tokens and requests the workers hold on a slot (the load feedback not included)."""
        return (self.table.total(slot, 0, self.worker_rows), self.table.total(slot, INFLIGHT, self.worker_rows))

    def _idle(self, slot: int) -> bool:
        return all(self.table.total(slot, c, self.worker_rows) == 0 for c in range(len(COLUMNS)))

    def _free_slot(self) -> int:
        used = {e.slot for e in self.replicas.values()} | set(self._retired)
        for slot in range(self.table.slots):
            if slot not in used:
                return slot
        raise TableError(f"more than {self.table.slots} replicas (or removed ones with requests still running)")

    def publish(self) -> None:
        """Write the set for the workers to follow."""
        entries = [{"slot": e.slot, "url": e.url, "weight": e.config.weight, "max_requests": e.config.max_requests,
                    "max_outstanding_tokens": e.config.max_outstanding_tokens, "draining": e.draining,
                    "cards": e.cards, "max_num_seqs": e.config.max_num_seqs or e.batch_cap,
                    "speed": e.config.speed.to_mapping() if e.config.speed else None}
                   for e in self.replicas.values()]
        self.table.write_blob(json.dumps(entries).encode())
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()


class Follower:
    """Keeps one worker's router equal to the published replica set; writes the worker's heartbeat and queue."""

    def __init__(self, table: LoadTable, row: int, router: Router,
                 on_cards: Callable[[], None] | None = None) -> None:
        self._table = table
        self._row = row
        self._router = router
        self._on_cards = on_cards  # told when the published set (model cards included) has changed
        self._version = -1
        self._hi = -1
        self._blob_seq = -1
        self._entries: list[dict[str, Any]] = []

    async def run(self) -> None:
        cells, floats = self._table.cells, self._table.floats
        heartbeat, queue = self._table.head_cell(self._row, R_HEARTBEAT), self._table.head_cell(self._row, R_QUEUE)
        while True:
            self.sync()
            floats[heartbeat] = time.monotonic()
            cells[queue] = self._router.queue_depth
            await asyncio.sleep(FOLLOW_S)

    def sync(self) -> None:
        """Apply whatever changed in the published set since the last call (nothing to do: two reads)."""
        table = self._table
        version, hi = table.version, table.hi
        if version == self._version and hi == self._hi:
            return
        self._version = version  # read first: a change made meanwhile shows as a new version next time
        if table.cells[H_BLOB_SEQ] != self._blob_seq:
            self._blob_seq, data = table.read_blob()
            self._entries = json.loads(data) if data else []
            if self._on_cards is not None:
                self._on_cards()
        rebind, self._hi = hi != self._hi, hi
        router, woke, seen = self._router, False, set()
        for item in self._entries:
            replica = self._replica(item, rebind)
            seen.add(replica.url)
            healthy = bool(table.cells[table.slot_cell(item["slot"], S_HEALTHY)]) and not table.ejected(item["slot"])
            woke = woke or (healthy and not replica.healthy)
            replica.healthy = healthy
        for url in [u for u in router.replicas if u not in seen]:
            router.remove(url)
        if woke:
            router.wake()

    def _replica(self, item: dict[str, Any], rebind: bool) -> Replica:
        config = ReplicaConfig(url=item["url"], weight=item["weight"], max_requests=item["max_requests"],
                               max_outstanding_tokens=item["max_outstanding_tokens"],
                               max_num_seqs=item.get("max_num_seqs"), speed=item.get("speed"))
        replica = self._router.replicas.get(config.url)
        if replica is None or replica.slot != item["slot"]:
            replica = self._router.replicas[config.url] = Replica(config)
            rebind = True
        if rebind:
            replica.bind(self._table, self._row, item["slot"], self._hi)
        replica.weight, replica.max_requests = config.weight, config.max_requests
        replica.max_outstanding_tokens = config.max_outstanding_tokens
        replica.max_num_seqs = config.max_num_seqs
        if config.speed is not None and config.speed != replica.speed:
            replica.speed = config.speed
        replica.draining = bool(item["draining"])
        replica.cards = item["cards"]
        replica.models = frozenset(replica.cards)
        return replica
