"""Several gateways in front of the same simulated replicas: imbalance and TTFT, with and without load feedback.

`sim serve` runs four OPT-1.3B replicas (max_num_seqs 64, 0.225 of the memory each) on one simulated GPU slowed
to 500 GB/s, so that this machine can stream what they generate (about 15 requests/s at capacity). 1, 2 or 4
real gateways (`gateway serve`, least-outstanding-tokens, no admission caps) front them; an open-loop client sends
the same Poisson arrivals of the `mixed` workload (90% short, 10% long requests, streaming, ignore_eos) at 50, 80
and 95% of capacity (computed in virtual time for the same node), spreading requests over the gateways in turn
as a load balancer in front of gateway pods would. Each gateway sees only its share unless `feedback` is on.

Imbalance: every 0.2 s the client reads each replica's `vllm:num_requests_running + waiting`; the figure is
the mean of max / mean over the samples where any replica had work. TTFT is measured at the client.

Everything runs in real time on the machine's cores (simulator, gateways, client): CPU contention from other
work inflates TTFTs, so compare configurations within one run, not across runs.

    python -m bench.multi_gateway [--gateways 1,2,4] [--loads 0.5,0.8,0.95] [--requests 360] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from deploy.ports import free_ports
from sim.fleet import capacity, saturation_sample
from sim.gpus import parse_gpu_spec
from sim.model import load_model
from sim.node import NodeSpec
from sim.workload import RequestSpec, mixed, poisson_arrivals

from .common import markdown_table, save
from .gateway_overhead import process

MODEL, GPU, REPLICAS, BATCH, UTIL = "opt-1.3b", "memory_gib=64,bandwidth_gbps=500,tflops=300", 4, 64, 0.225
SERVED = "facebook/opt-1.3b"


def node() -> NodeSpec:
    return NodeSpec(load_model(MODEL), parse_gpu_spec(GPU), REPLICAS, BATCH, UTIL)


@contextlib.contextmanager
def gateways(replicas: list[str], count: int, feedback: dict[str, Any]) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(count):
            port = free_ports()
            path = Path(tempfile.mkdtemp()) / "gateway.yaml"
            path.write_text(json.dumps({"replicas": replicas, "host": "127.0.0.1", "port": port,
                                        "log_level": "warning", "health": {"interval_s": 2, "timeout_s": 2},
                                        "timeouts": {"connect_s": 5, "first_byte_s": 300, "idle_s": 120},
                                        "feedback": feedback}))
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(process([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
                                        url + "/ready"))
            urls.append(url)
        yield urls


async def _load(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _one(session: aiohttp.ClientSession, url: str, spec: RequestSpec, ttfts: list[float],
               errors: list[str]) -> None:
    body = {"model": SERVED, "prompt": " tok" * spec.prompt_tokens, "max_tokens": spec.output_tokens,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                errors.append(f"status {resp.status}")
                return
            first = None
            async for chunk in resp.content.iter_any():
                if first is None and b"data: {" in chunk:
                    first = time.perf_counter()
            if first is not None:
                ttfts.append(first - start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        errors.append(repr(exc))


async def run_point(gateway_urls: list[str], replica_urls: list[str], specs: list[RequestSpec],
                    arrivals: np.ndarray) -> dict[str, Any]:
    ttfts: list[float] = []
    errors: list[str] = []
    ratios: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10, sock_read=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        while sum([await _load(session, u) for u in replica_urls]) > 0:  # idle replicas before each point
            await asyncio.sleep(0.2)
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                loads = [await _load(session, u) for u in replica_urls]
                mean = sum(loads) / len(loads)
                if mean > 0:
                    ratios.append(max(loads) / mean)
                await asyncio.sleep(0.2)

        sampler = asyncio.create_task(sample())
        loop, tasks = asyncio.get_running_loop(), []
        t0 = loop.time()
        for i, (spec, at) in enumerate(zip(specs, arrivals)):
            delay = t0 + float(at) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, gateway_urls[i % len(gateway_urls)], spec, ttfts,
                                                  errors)))
        await asyncio.gather(*tasks)
        done.set()
        await sampler
    ordered = sorted(ttfts)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1e3 if ordered else float("nan")
    return {"requests": len(specs), "ok": len(ttfts), "errors": len(errors), "ttft_p50_ms": pct(50),
            "ttft_p99_ms": pct(99), "imbalance": statistics.mean(ratios) if ratios else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateways", default="1,2,4")
    parser.add_argument("--loads", default="0.5,0.8,0.95")
    parser.add_argument("--requests", type=int, default=360)
    parser.add_argument("--interval", type=float, default=0.5, help="feedback scrape interval (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true", help="print only; do not write docs/bench")
    args = parser.parse_args()
    counts = [int(g) for g in args.gateways.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    spec = node()
    specs = mixed(args.requests, np.random.default_rng(args.seed))
    cap = capacity(spec, saturation_sample(spec, mixed(2000, np.random.default_rng(args.seed))))
    print(f"capacity {cap:.2f} requests/s (virtual time)", file=sys.stderr)
    configs = [(g, fb) for g in counts for fb in ((False,) if g == 1 else (False, True))]
    rows: list[dict[str, Any]] = []
    base = free_ports(REPLICAS)
    replica_urls = [f"http://127.0.0.1:{base + i}" for i in range(REPLICAS)]
    sim_argv = [sys.executable, "-m", "sim.cli", "serve", "--model", MODEL, "--gpu-spec", GPU, "--replicas",
                str(REPLICAS), "--max-num-seqs", str(BATCH), "--gpu-memory-utilization", str(UTIL), "--port",
                str(base), "--served-model-name", SERVED, "--log-level", "warning"]
    with process(sim_argv, replica_urls[-1] + "/health"):
        for g, fb in configs:
            feedback = {"enabled": fb, "interval_s": args.interval}
            with gateways(replica_urls, g, feedback) as urls:
                time.sleep(2.5)  # a health round (and a few scrapes) before traffic
                for load in loads:
                    arrivals = poisson_arrivals(args.requests, load * cap, np.random.default_rng(args.seed + 1))
                    point = asyncio.run(run_point(urls, replica_urls, specs, arrivals))
                    row = {"gateways": g, "feedback": fb, "load": load, **point}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    single = {r["load"]: r for r in rows if r["gateways"] == 1}
    table_rows = []
    for r in rows:
        ref = single.get(r["load"])
        ratio = r["ttft_p99_ms"] / ref["ttft_p99_ms"] if ref else float("nan")
        r["p99_vs_one_gateway"] = ratio
        table_rows.append([r["gateways"], "on" if r["feedback"] else "off", f"{r['load']:.0%}",
                           f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}", f"{ratio:.2f}",
                           f"{r['imbalance']:.2f}", r["errors"]])
    table = markdown_table(["gateways", "feedback", "load", "TTFT p50 ms", "TTFT p99 ms", "p99 / 1 gateway",
                            "imbalance", "errors"], table_rows)
    print(table)
    if not args.no_save:
        save("multi_gateway", {"capacity_rps": cap, "requests": args.requests, "interval_s": args.interval,
                               "rows": rows}, table)


if __name__ == "__main__":
    main()
