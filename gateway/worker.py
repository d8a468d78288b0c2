"""One worker of `gateway serve --workers N`, started by the supervisor (gateway/workers.py), never by hand.

It reads its spec (the config, its row of the load table, the file descriptors of the table and of its listening
socket) as JSON on standard input, serves on the inherited socket, and stops gracefully on SIGTERM or SIGINT, or
when the supervisor is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from .app import freeze_startup_objects, running
from .config import from_mapping
from .table import R_STATE, STATE_DRAINING, LoadTable

logger = logging.getLogger(__name__)

ORPHAN_CHECK_S = 0.5


async def serve(spec: dict[str, Any]) -> None:
    """Serve until told to stop; requests in flight then get the supervisor's grace period."""
    from .workers import GRACE_S

    config = from_mapping(spec["config"])
    table = LoadTable.attach(spec["table_fd"])
    row = int(spec["row"])
    sock = socket.socket(fileno=spec["socket_fd"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)  # the supervisor's business: it replaces the workers
    async with running(config, grace_s=GRACE_S, table=table, row=row, sock=sock,
                       admin_socket=spec.get("admin_socket")):
        freeze_startup_objects()
        orphan = asyncio.create_task(_until_orphaned(int(spec["parent"]), stop))
        await stop.wait()
        orphan.cancel()
        table.cells[table.head_cell(row, R_STATE)] = STATE_DRAINING
        logger.info("worker %d stopping: finishing the requests in flight", os.getpid())


async def _until_orphaned(parent: int, stop: asyncio.Event) -> None:
    """Stop when the supervisor is gone (killed with SIGKILL, say): nobody would restart or reap this worker."""
    while os.getppid() == parent:
        await asyncio.sleep(ORPHAN_CHECK_S)
    logger.error("worker %d: the supervisor %d is gone; stopping", os.getpid(), parent)
    stop.set()


def main() -> None:
    import uvloop

    spec = json.loads(sys.stdin.read())
    level = str(spec["config"].get("log_level", "info")).upper()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s worker-{spec['row']} %(name)s: %(message)s")
    uvloop.run(serve(spec))


if __name__ == "__main__":
    main()
