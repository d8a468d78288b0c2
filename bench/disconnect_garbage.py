"""How much cyclic garbage the gateway is left with when queued clients go away at once.

A flood's clients leaving together (a batch job stopped, the cut-off of bench.fairness_vllm) drop hundreds of queued
requests at once. What each leaves in reference cycles waits for a full collection, which pauses the gateway's loop
for all of it (docs/priority.md). This queues `--requests` streamed requests behind a FAKE replica (one slot's
worth of cap), drops them all, and counts what a collection then finds, by type.

    python -m bench.disconnect_garbage [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import sys
import time

import aiohttp

from bench.gateway_overhead import process
from bench.priority_load import gateway_mapping
from deploy.ports import free_ports
from gateway.app import running
from gateway.config import from_mapping


async def measure(requests: int) -> tuple[int, int, float, list[tuple[str, int]]]:
    """(queued when dropped, cyclic objects collected, the collection's ms, the commonest types)."""
    port = free_ports()
    argv = [sys.executable, "-m", "tests.fake_replica", "--port", str(port), "--itl", "0.05", "--model", "tiny-opt"]
    with process(argv, f"http://127.0.0.1:{port}/health"):
        config = from_mapping(gateway_mapping(f"http://127.0.0.1:{port}", 8, 7) | {"port": 0})
        async with running(config, grace_s=1) as (gateway, gateway_port):
            assert gateway.health is not None
            await gateway.health.probe_all()
            gc.collect()
            gc.disable()
            try:
                url = f"http://127.0.0.1:{gateway_port}/v1/completions"
                body = {"model": "tiny-opt", "prompt": "hello there", "max_tokens": 40, "stream": True}
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
                    async def one() -> None:
                        async with client.post(url, json=body, headers={"x-tenant": "flood"}) as answer:
                            async for _ in answer.content:
                                pass

                    tasks = [asyncio.create_task(one()) for _ in range(requests)]
                    await asyncio.sleep(2.0)
                    queued = gateway.router.queue_depth
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.sleep(1.0)
                gc.set_debug(gc.DEBUG_SAVEALL)
                started = time.perf_counter()
                found = gc.collect()
                took = (time.perf_counter() - started) * 1e3
                types = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
    return queued, found, took, types.most_common(12)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    queued, found, took, types = asyncio.run(measure(args.requests))
    print(f"{args.requests} requests dropped ({queued} of them queued): a collection found {found} cyclic objects, "
          f"{found / args.requests:.1f} a request, in {took:.1f} ms (this process: the gateway and the load's "
          f"clients; the fake replica runs apart)")
    for name, count in types:
        print(f"{count:8d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
