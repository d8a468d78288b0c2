"""File descriptors: raise the soft limit at start, and derive how many client connections fit under it."""

from __future__ import annotations

import errno
import logging
import resource
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
# The gateway's own descriptors (listening sockets, event loop, logs, health probes) and connections being refused.
RESERVED = 64
_UNLIMITED_FALLBACK = 1 << 20  # Linux's default fs.nr_open


@dataclass(frozen=True)
class FdLimit:
    """RLIMIT_NOFILE before and after `raise_fd_limit`."""

    before: int
    soft: int
    hard: int


def _finite(limit: int) -> int:
    if limit != resource.RLIM_INFINITY:
        return limit
    try:  # an unlimited hard limit still stops at fs.nr_open
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return _UNLIMITED_FALLBACK


def raise_fd_limit() -> FdLimit:
    """Raise the soft RLIMIT_NOFILE to the hard limit (what nginx's worker_rlimit_nofile does), and log both."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _finite(hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft, target, exc)
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    logger.info("file descriptors: soft limit %d (was %d), hard limit %s", now, soft,
                "unlimited" if hard == resource.RLIM_INFINITY else hard)
    return FdLimit(soft, now, hard)


def default_max_connections(soft: int | None = None) -> int:
    """Client connections that fit under the soft limit: each may hold a second descriptor, to a replica."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, (_finite(soft) - RESERVED) // 2)


class Throttled:
    """A warning that every request may repeat under overload, logged at most once per `interval_s` with a count."""

    def __init__(self, log: logging.Logger, interval_s: float = 1.0) -> None:
        self._log = log
        self._interval_s = interval_s
        self._next = 0.0
        self._count = 0

    def warning(self, message: str, *args: object) -> None:
        self._count += 1
        now = time.monotonic()
        if now >= self._next:
            self._log.warning(message + " (%d time(s) since the last such warning)", *args, self._count)
            self._next, self._count = now + self._interval_s, 0
