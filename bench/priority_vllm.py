"""Interactive TTFT alone and under floods, on a real vLLM-CPU replica, pooled over rounds: issue #19's 1.2 x mark.

tests/test_priority_vllm.py asserts the mark on 30 samples a phase, where p99 is the slowest sample and one slow
decode step decides it. This runs the same phases (bench/priority_load.py: interactive alone; under a batch flood,
by priority; under one heavy tenant's flood in the interactive band, by fairness) for several rounds, each round
its phases in turn on one gateway, so a slow moment of the machine falls on every phase alike, and pools each
phase's samples over the rounds. Two more phases give the engine's own part, no gateway: "direct alone",
interactive requests sent straight to the replica, and "direct", the same while as many flood clients as the
gateway lets run beside them (cap less headroom) send straight to it too. It reports the pooled p50/p90/p99 and each round's p99 ratio, and writes JSON.

    python -m bench.priority_vllm [--rounds 4] [--samples 100] [--replica URL | --replica-cpus 1] [--out FILE]

Without --replica it starts the test's replica: the tiny model, `--max-num-seqs 8 --scheduling-policy priority`,
10 below normal CPU priority (deploy's default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS
from bench.priority_load import compare, phase
from deploy.ports import free_ports
from deploy.hardware import cpu_list, usable_cpus
from deploy.models import TINY_MODEL_ARGS
from deploy.plan import ReplicaSpec
from deploy.process import VllmServer
from deploy.tinymodel import ensure_tiny_model

MODEL = "tiny-opt"
PHASES = ("alone", "priority", "tenants", "direct alone", "direct")
BASE = {"priority": "alone", "tenants": "alone", "direct": "direct alone"}  # each ratio's denominator


def replica_server(log: Path, cpus: tuple[int, ...] = (), trace_url: str | None = None) -> VllmServer:
    """The replica of tests/test_priority_vllm.py and of this benchmark, not yet started (a context manager), on
    `cpus` (default: every core this process may use); with `trace_url`, exporting its spans there (OTLP/HTTP)."""
    tracing = ("--otlp-traces-endpoint", trace_url) if trace_url else ()
    spec = ReplicaSpec(name="priority", model=str(ensure_tiny_model()), port=free_ports(), max_num_seqs=8,
                       max_model_len=512, cpu_kvcache_space_gib=1, served_model_name=MODEL,
                       extra_args=("--scheduling-policy", "priority", *(a for flag in TINY_MODEL_ARGS for a in flag),
                                   *tracing))  # eager and float32, as deploy serves the tiny model
    cpus = cpus or usable_cpus()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus)}
    if trace_url:
        env |= {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}
    return VllmServer(spec, log, env, startup_timeout_s=420, cpus=cpus)


def split_cores(spec: str) -> tuple[tuple[int, ...], set[int]]:
    """`--replica-cpus`'s cores ("1", "2,3"; "" for none: the replica shares every core) and the cores left to
    this process; ValueError unless they are some, not all, of the cores it may use."""
    replica_cpus, usable = tuple(int(c) for c in spec.split(",") if c), usable_cpus()
    rest = set(usable) - set(replica_cpus)
    if replica_cpus and (not set(replica_cpus) <= set(usable) or not rest):
        raise ValueError(f"--replica-cpus must be some, not all, of this process's cores {usable}")
    return replica_cpus, rest


def add_replica_cpus(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica-cpus", default="", help="cores for the started replica, e.g. 1 (this process, "
                        "the gateway and the clients then keep to the others); default: every core, shared")


def replica_cores(parser: argparse.ArgumentParser, spec: str) -> tuple[tuple[int, ...], set[int]]:
    """`split_cores(spec)`, a bad one refused as the parser refuses arguments."""
    try:
        return split_cores(spec)
    except ValueError as exc:
        parser.error(str(exc))


def open_replica(stack: ExitStack, url: str | None, cores: tuple[tuple[int, ...], set[int]], log: Path,
                 trace_url: str | None = None) -> str:
    """`url`, or the URL of `replica_server` started on `cores`' first part (entered on `stack`; tracing to
    `trace_url`); with cores given, this process then keeps to the rest (after the start: the replica keeps its
    own)."""
    if url:
        return url
    replica_cpus, rest = cores
    url = stack.enter_context(replica_server(log, replica_cpus, trace_url)).url
    if replica_cpus:
        os.sched_setaffinity(0, rest)
    return url


def unwind_on_sigterm() -> None:
    """SIGTERM (a time limit, `timeout`) unwinds like Ctrl-C, so the replica and gateway started are stopped: the
    default would end this process and leave them running."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)


def percentiles(samples: list[float]) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(samples, q)) for q in (50, 90, 99)}


def summarize(rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Pooled percentiles per phase, the pooled p99 and p90 ratios to the phase alone (BASE), and each round's p99
    ratios."""
    pooled = {name: [t for r in rounds for t in r[name]] for name in PHASES}
    stats = {name: percentiles(samples) | {"n": len(samples)} for name, samples in pooled.items()}
    per_round = [{name: float(np.percentile(r[name], 99) / np.percentile(r[base], 99)) for name, base in BASE.items()}
                 for r in rounds]
    return {"pooled": stats, "p99_x_alone": {n: stats[n]["p99"] / stats[b]["p99"] for n, b in BASE.items()},
            "p90_x_alone": {n: stats[n]["p90"] / stats[b]["p90"] for n, b in BASE.items()},
            "rounds_p99_x_alone": per_round}


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"`{result['command']}`: {result['rounds']} rounds of {result['samples']} interactive samples a phase, "
             f"pooled ({result['seconds']:.0f} s).", "",
             "| phase | n | p50 ms | p90 ms | p99 ms | p99 x alone (direct: x direct alone) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in PHASES:
        st = s["pooled"][name]
        ratio = f"{s['p99_x_alone'][name]:.2f}" if name in BASE else ""
        lines.append(f"| {name} | {st['n']} | {st['p50'] * 1e3:.1f} | {st['p90'] * 1e3:.1f} | {st['p99'] * 1e3:.1f} "
                     f"| {ratio} |")
    lines += ["", "Each round's p99 x its own alone: " + "; ".join(
        ", ".join(f"{k} {v:.2f}" for k, v in r.items()) for r in s["rounds_p99_x_alone"])]
    return "\n".join(lines)


async def measure(replica: str, args: argparse.Namespace) -> list[dict[str, list[float]]]:
    rounds = []
    for i in range(args.rounds):
        result = await compare(replica, MODEL, args.cap, args.headroom, args.flood, args.samples, args.gap,
                               fifo_samples=0, tenants=True)
        result["direct alone"] = await phase(replica + "/v1", MODEL, 0, args.samples, args.gap)
        result["direct"] = await phase(replica + "/v1", MODEL, args.cap - args.headroom, args.samples, args.gap)
        for name in BASE:
            if result[name].batch_done == 0 or result[name].batch_failed:
                raise RuntimeError(f"round {i + 1}, {name}: the flood did not run cleanly "
                                   f"({result[name].batch_done} done, {result[name].batch_failed} failed)")
        rounds.append({name: list(result[name].ttft) for name in PHASES})
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(
            f"{n} p99 {np.percentile(rounds[-1][n], 99) * 1e3:.0f} ms" for n in PHASES), file=sys.stderr)
    return rounds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", help="a running replica serving the tiny model as tiny-opt (default: start one)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--samples", type=int, default=100, help="interactive samples per phase per round")
    parser.add_argument("--cap", type=int, default=4)
    parser.add_argument("--headroom", type=int, default=2)
    parser.add_argument("--flood", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.1)
    add_replica_cpus(parser)
    parser.add_argument("--out", type=Path, default=RESULTS / "priority_vllm.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.samples < 1:
        parser.error("--rounds and --samples must be at least 1")
    cores = replica_cores(parser, args.replica_cpus)
    unwind_on_sigterm()
    with ExitStack() as stack:
        replica = open_replica(stack, args.replica, cores,
                               Path(tempfile.mkdtemp(prefix="priority-vllm-")) / "vllm.log")
        started = time.monotonic()
        rounds = asyncio.run(measure(replica, args))
        seconds = time.monotonic() - started
    result = {"command": " ".join(["python -m bench.priority_vllm", *sys.argv[1:]]), "rounds": args.rounds,
              "samples": args.samples, "seconds": seconds, "cap": args.cap, "headroom": args.headroom,
              "flood": args.flood, "gap_s": args.gap,
              "replica_cpus": list(cores[0]), "ttft_s": rounds, "summary": summarize(rounds)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(report(result))


if __name__ == "__main__":
    main()
