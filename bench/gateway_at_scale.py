"""The real gateway in front of many simulated replicas, streaming: tokens/s through the gateway against direct.

`sim serve` (one process) runs R simulated OPT-125M replicas on one simulated H100 80 GB; the gateway
(`python -m gateway.cli serve`, another process) fronts them with least-outstanding-tokens routing. A closed-loop
client (this process, uvloop + aiohttp) keeps C streaming completions in flight, either spread round-robin
over the replicas directly or all through the gateway, and counts the SSE token chunks it receives.

The simulated GPU could produce far more tokens/s than this machine can serialize, so the ceiling measured is
the machine's: everything (replicas, gateway, client, and teammates' work) shares its 2 cores. What the numbers
show is what the gateway's hop costs where CPU is the limit, not what it costs next to a real GPU.

    python -m bench.gateway_at_scale [--replicas 16] [--concurrency 32,128,512] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from deploy.ports import free_ports
from deploy.process import ManagedProcess

from .common import figure_path, markdown_table, pyplot, save

MODEL = "facebook/opt-125m"
OUTPUT_TOKENS = 128


@dataclass(frozen=True)
class Point:
    """One measurement: where the client sent its requests, how many at once, and what came back."""

    target: str
    concurrency: int
    tokens_s: float
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float


async def _one(session: aiohttp.ClientSession, url: str, ttfts: list[float], itls: list[float],
               window: list[float], counted: list[int]) -> int:
    body = {"model": MODEL, "prompt": "hello " * 32, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    tokens, first = 0, None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
        async for chunk in resp.content.iter_any():
            count = chunk.count(b"data: {")
            now = time.perf_counter()
            if count and first is None:
                first = now
            if window[0] <= now <= window[1]:
                counted[0] += count
            tokens += count
    end = time.perf_counter()
    if first is not None:
        ttfts.append(first - start)
        if tokens > 1:
            itls.append((end - first) / (tokens - 1))
    return tokens


async def measure(urls: list[str], target: str, concurrency: int, seconds: float) -> Point:
    """Closed loop at `concurrency` for `seconds` (after a 1 s warm-up); token chunks counted as they arrive
    inside the window, requests counted when they end inside it."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=5, sock_read=60)
    counted = [0]
    done = errors = 0
    ttfts: list[float] = []
    itls: list[float] = []
    window = [float("inf"), float("inf")]
    rr = itertools.cycle(urls)

    async def worker(url: str) -> None:
        nonlocal done, errors
        while time.perf_counter() < window[1]:
            try:
                await _one(session, url, ttfts, itls, window, counted)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1
                continue
            if window[0] <= time.perf_counter() <= window[1]:
                done += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        now = time.perf_counter()
        window[:] = [now + 1.0, now + 1.0 + seconds]
        await asyncio.gather(*(worker(next(rr)) for _ in range(concurrency)))
    elapsed = seconds
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else [float("nan")] * 99
    return Point(target, concurrency, counted[0] / elapsed, done, errors, 1e3 * statistics.median(ttfts),
                 1e3 * q[98], 1e3 * statistics.mean(itls) if itls else float("nan"))


def _wait_ready(url: str, replicas: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if len(json.loads(resp.read())["healthy_replicas"]) == replicas:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway at {url} did not see {replicas} healthy replicas in {timeout_s:g} s")


def run(replicas: int, concurrencies: list[int], seconds: float, logs: Path) -> list[Point]:
    base = free_ports(replicas + 1)
    sim_argv = [sys.executable, "-m", "sim.cli", "serve", "--model", "opt-125m", "--gpu", "H100-80GB",
                "--replicas", str(replicas), "--port", str(base), "--max-num-seqs", "256", "--log-level", "warning"]
    urls = [f"http://127.0.0.1:{base + i}" for i in range(replicas)]
    gw_port = base + replicas
    gw_argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(gw_port), "--host", "127.0.0.1",
               "--log-level", "warning", *itertools.chain.from_iterable(("--replica", u) for u in urls)]
    gateway = f"http://127.0.0.1:{gw_port}"
    points = []
    with ManagedProcess("sim", sim_argv, logs / "sim.log", urls[-1] + "/health", startup_timeout_s=60):
        with ManagedProcess("gateway", gw_argv, logs / "gateway.log", gateway + "/health", startup_timeout_s=60):
            _wait_ready(gateway, replicas)
            for c in concurrencies:
                for target, targets in (("direct", urls), ("gateway", [gateway])):
                    point = asyncio.run(measure(targets, target, c, seconds))
                    print(f"  {target:8s} C={c:4d}: {point.tokens_s:8,.0f} tok/s, TTFT p50 {point.ttft_p50_ms:.0f} ms"
                          f" p99 {point.ttft_p99_ms:.0f} ms, ITL {point.itl_mean_ms:.1f} ms, errors {point.errors}")
                    points.append(point)
    return points


def plot(points: list[Point], replicas: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for target, style in (("direct", "-o"), ("gateway", "--s")):
        mine = [p for p in points if p.target == target]
        axes[0].plot([p.concurrency for p in mine], [p.tokens_s for p in mine], style, label=target)
        axes[1].plot([p.concurrency for p in mine], [p.itl_mean_ms for p in mine], style, label=target)
    for ax, label in zip(axes, ("token chunks received per second", "mean inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("streams in flight")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Gateway vs direct: {replicas} simulated OPT-125M replicas, one 2-core machine")
    fig.tight_layout()
    fig.savefig(figure_path("gateway_at_scale.png"), dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--concurrency", default="32,128,512", help="streams in flight, comma-separated")
    parser.add_argument("--seconds", type=float, default=8.0, help="measurement window per point (8)")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    import uvloop

    uvloop.install()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gateway-at-scale-") as tmp:
        points = run(args.replicas, concurrencies, args.seconds, Path(tmp))
    rows = [[p.target, p.concurrency, f"{p.tokens_s:,.0f}", p.requests, p.errors, f"{p.ttft_p50_ms:.0f}",
             f"{p.ttft_p99_ms:.0f}", f"{p.itl_mean_ms:.1f}"] for p in points]
    text = markdown_table(["target", "streams", "tokens/s", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms",
                           "mean ITL ms"], rows)
    save("gateway_at_scale", {"replicas": args.replicas, "output_tokens": OUTPUT_TOKENS,
                              "points": [asdict(p) for p in points]}, text)
    plot(points, args.replicas)
    print(text)
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
