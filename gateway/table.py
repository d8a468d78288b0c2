"""The load table: the gateway's one picture of every replica's load, in memory that every worker maps.

Like prometheus-client's multiprocess mode, each process writes only its own row and readers sum the rows, so no
lock is taken on the request path. Row 0 belongs to the control plane (the replica-load feedback from vLLM's
`/metrics` is written there, as if it were one more worker); rows 1.. belong to the workers. A row holds, for
every replica slot, one int64 cell per counter in `COLUMNS`: a pick sums a column over the rows in use.

Layout, in one shared mapping (int64 cells; the cells marked (f) hold float64):

    header      HEADER_CELLS    geometry, `hi` (rows in use), directory and blob versions, restarts
    slots       SLOT_CELLS each replica slot: healthy, health generation, vLLM's running/waiting/KV (f), ...
    row heads   ROW_CELLS each  a worker's pid, state, heartbeat (f), queue depth, ejection version
    counters    rows x slots x len(COLUMNS)
    ejections   rows x slots    the health generation at which that row's worker ejected that slot
    blob        BLOB_BYTES      the replica set as JSON (URLs, weights, caps, model cards), seqlock'd
    metrics     rows x METRIC_BYTES, each an append-only map of metric keys to float64 values (metrics.py)

Only the control plane writes the header, the slots and the blob; only a row's worker writes that row (the
supervisor zeroes a dead worker's row before its replacement starts). Reads of other rows are not atomic with a
worker's own write: a pick sees each cell as some worker last wrote it, never a torn value (aligned 8-byte
stores), and never more than one unfinished pick per worker.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

COLUMNS = ("outstanding", "inflight", "prefill")  # a counter per replica: its name here, a `Replica` attribute
OUTSTANDING, INFLIGHT, PREFILL = 0, 1, 2

SLOTS = 512
HEADER_CELLS = 16
SLOT_CELLS = 8
ROW_CELLS = 8
BLOB_BYTES = 1 << 20
METRIC_BYTES = 1 << 20
MAGIC = 0x534D414C4C535256  # "SMALLSRV"
LAYOUT = 1

# header cells
H_MAGIC, H_LAYOUT, H_ROWS, H_SLOTS, H_COLUMNS, H_HI, H_DIRECTORY, H_BLOB_SEQ, H_BLOB_LEN, H_RESTARTS = range(10)
# slot cells: S_RUNNING, S_WAITING, S_KV, S_SCRAPED hold floats
S_HEALTHY, S_HEALTH_GEN, S_RUNNING, S_WAITING, S_KV, S_SCRAPED = range(6)
# row-head cells: R_HEARTBEAT holds a float (time.monotonic(), one clock for every process on the machine)
R_PID, R_STATE, R_HEARTBEAT, R_QUEUE, R_EJECTIONS = range(5)
STATE_FREE, STATE_STARTING, STATE_READY, STATE_DRAINING = 0, 1, 2, 3


class TableError(RuntimeError):
    """The shared table cannot hold what was asked (too many replicas, a blob too large) or is not one."""


class LoadTable:
    """One mapping of the layout above, with views by cell (int64) and by float64."""

    def __init__(self, buffer: mmap.mmap, fd: int | None = None) -> None:
        self.buffer = buffer
        self.fd = fd  # the memory's file descriptor, passed to workers (None: private to this process)
        self.cells = memoryview(buffer).cast("q")
        self.floats = memoryview(buffer).cast("d")
        if self.cells[H_MAGIC] != MAGIC or self.cells[H_LAYOUT] != LAYOUT:
            raise TableError("not a smallserve load table (or one of another layout)")
        self.rows = int(self.cells[H_ROWS])
        self.slots = int(self.cells[H_SLOTS])
        self.width = int(self.cells[H_COLUMNS])
        if self.width != len(COLUMNS):
            raise TableError(f"the table has {self.width} columns, this gateway counts {len(COLUMNS)}")
        self.slot_base = HEADER_CELLS
        self.head_base = self.slot_base + self.slots * SLOT_CELLS
        self.counter_base = self.head_base + self.rows * ROW_CELLS
        self.row_stride = self.slots * self.width
        self.eject_base = self.counter_base + self.rows * self.row_stride
        self.blob_offset = (self.eject_base + self.rows * self.slots) * 8
        self.metric_offset = self.blob_offset + BLOB_BYTES

    # -- creating and attaching --------------------------------------------------------------------------------
    @staticmethod
    def size(rows: int, slots: int = SLOTS) -> int:
        cells = HEADER_CELLS + slots * SLOT_CELLS + rows * (ROW_CELLS + slots * len(COLUMNS) + slots)
        return cells * 8 + BLOB_BYTES + rows * METRIC_BYTES

    @classmethod
    def create(cls, rows: int, slots: int = SLOTS, shared: bool = False) -> LoadTable:
        """A zeroed table of `rows` rows; `shared`: backed by a file descriptor that worker processes can map."""
        size = cls.size(rows, slots)
        fd = None
        if shared:
            fd = _anonymous_file()
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
        else:
            buffer = mmap.mmap(-1, size)
        cells = memoryview(buffer).cast("q")
        cells[H_MAGIC], cells[H_LAYOUT], cells[H_ROWS], cells[H_SLOTS] = MAGIC, LAYOUT, rows, slots
        cells[H_COLUMNS], cells[H_HI] = len(COLUMNS), rows
        cells.release()
        return cls(buffer, fd)

    @classmethod
    def attach(cls, fd: int) -> LoadTable:
        """The table another process created, from its file descriptor."""
        return cls(mmap.mmap(fd, os.fstat(fd).st_size), fd)

    # -- cells --------------------------------------------------------------------------------------------------
    def slot_cell(self, slot: int, cell: int) -> int:
        return self.slot_base + slot * SLOT_CELLS + cell

    def head_cell(self, row: int, cell: int) -> int:
        return self.head_base + row * ROW_CELLS + cell

    def counter(self, row: int, slot: int, column: int = 0) -> int:
        return self.counter_base + row * self.row_stride + slot * self.width + column

    def ejection(self, row: int, slot: int) -> int:
        return self.eject_base + row * self.slots + slot

    @property
    def hi(self) -> int:
        """Rows in use are all below this one: readers sum rows [0, hi)."""
        return int(self.cells[H_HI])

    def column(self, slot: int, column: int, hi: int) -> memoryview:
        """Every row's cell of one counter of one slot, rows [0, hi): `sum()` of it is the gateway-wide value."""
        start = self.counter(0, slot, column)
        return self.cells[start:start + hi * self.row_stride:self.row_stride]

    def total(self, slot: int, column: int, rows: range) -> int:
        """One counter of one slot summed over `rows`."""
        return sum(self.cells[self.counter(row, slot, column)] for row in rows)

    def ejected(self, slot: int) -> bool:
        """Whether a worker ejected the slot's replica since its last good probe."""
        generation = self.cells[self.slot_cell(slot, S_HEALTH_GEN)]
        return any(self.cells[self.ejection(row, slot)] == generation for row in range(self.hi))

    def clear_row(self, row: int) -> None:
        """Forget a dead worker's reservations, queue and ejections (its metrics stay: they are counts so far)."""
        start = self.counter(row, 0, 0)
        self.cells[start:start + self.row_stride] = memoryview(bytes(self.row_stride * 8)).cast("q")
        start = self.ejection(row, 0)
        self.cells[start:start + self.slots] = memoryview(bytes(self.slots * 8)).cast("q")
        for cell in (R_PID, R_STATE, R_QUEUE):
            self.cells[self.head_cell(row, cell)] = 0
        self.floats[self.head_cell(row, R_HEARTBEAT)] = 0.0
        self.touch()  # its ejections lapsed: followers look again

    def clear_slot(self, slot: int) -> None:
        """A slot given to a new replica starts from nothing (its counters are all zero before it is reused)."""
        for cell in range(SLOT_CELLS):
            self.cells[self.slot_cell(slot, cell)] = 0
        for row in range(self.rows):
            self.cells[self.ejection(row, slot)] = 0

    # -- the directory blob (seqlock: odd while written) --------------------------------------------------------
    def write_blob(self, data: bytes) -> None:
        if len(data) > BLOB_BYTES:
            raise TableError(f"the replica set takes {len(data)} bytes, more than the table's {BLOB_BYTES}")
        self.cells[H_BLOB_SEQ] += 1
        self.buffer[self.blob_offset:self.blob_offset + len(data)] = data
        self.cells[H_BLOB_LEN] = len(data)
        self.cells[H_BLOB_SEQ] += 1
        self.cells[H_DIRECTORY] += 1

    def read_blob(self, timeout_s: float = 1.0) -> tuple[int, bytes]:
        """The blob and its version, read between two equal even versions."""
        deadline = time.monotonic() + timeout_s
        while True:
            before = int(self.cells[H_BLOB_SEQ])
            data = bytes(self.buffer[self.blob_offset:self.blob_offset + int(self.cells[H_BLOB_LEN])])
            if before % 2 == 0 and self.cells[H_BLOB_SEQ] == before:
                return before, data
            if time.monotonic() > deadline:
                raise TableError("the replica set stayed half-written for a second")
            time.sleep(0.0005)

    def touch(self) -> None:
        """Tell every follower that something in the directory changed."""
        self.cells[H_DIRECTORY] += 1

    @property
    def version(self) -> int:
        """A number that changes whenever the directory or any worker's ejections change."""
        version = int(self.cells[H_DIRECTORY])
        for row in range(self.hi):
            version += int(self.cells[self.head_cell(row, R_EJECTIONS)])
        return version

    def metric_region(self, row: int) -> memoryview:
        start = self.metric_offset + row * METRIC_BYTES
        return memoryview(self.buffer)[start:start + METRIC_BYTES]


def _anonymous_file() -> int:
    """A file descriptor of memory with no name on disk (memfd on Linux; an unlinked temporary file elsewhere)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("smallserve-load-table")
    handle = tempfile.TemporaryFile()
    return os.dup(handle.fileno())
