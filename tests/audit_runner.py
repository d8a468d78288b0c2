"""Run the gateway, then record every module import and file open (Python audit events) until stdin closes.

`python -m tests.audit_runner REPLICA_URL`: prints the port, then `armed` once the gateway is ready and the
audit hook is in place; on end of stdin prints the recorded events as JSON lines and exits.
Used by tests/test_gateway_security.py to show that serving requests imports and opens nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import aiohttp
import uvloop

from gateway.app import running
from gateway.config import from_mapping

WATCHED = ("import", "open", "os.listdir", "os.scandir")


async def main(replica: str) -> None:
    config = from_mapping({"replicas": [replica], "host": "127.0.0.1", "port": 0,
                           "health": {"interval_s": 0.2, "timeout_s": 2}})
    async with running(config, grace_s=1) as (gateway, port):
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(f"http://127.0.0.1:{port}/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
        events: list[tuple[str, str]] = []
        sys.addaudithook(lambda event, args: events.append((event, repr(args)[:300])) if event in WATCHED else None)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(sys.stdin.fileno(), lambda: done.set() if not sys.stdin.buffer.read1(1) else None)
        print(port, flush=True)
        print("armed", flush=True)
        await done.wait()
        loop.remove_reader(sys.stdin.fileno())
        recorded = list(events)
    for event in recorded:
        print(json.dumps(event), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(main(sys.argv[1]))
