"""Does a vLLM-CPU replica's API server slow its own engine? One real replica under bursty load, its API server on
its engine's core (as `deploy up` runs a CPU replica: every process of a replica on its own cores) or on another
core, alternated.

On a GPU the API server runs on host cores of its own, and the simulator models it so: a front end that delays
requests and chunks, beside an engine it does not slow. On this 2-core test bed a replica's API server shares its
engine's core. In a burst of arrivals it parses and tokenizes while the engine prefills them, and the two take
turns on one core. `bench.sim_vs_real` under gamma arrivals found the real replicas' first tokens late against
the simulator given each run's speed (docs/sim.md, "Bursty arrivals"); this measures how much of a first token's
time that sharing costs.

One replica of the tiny model, as `deploy up --model tiny` starts one, confined to `--engine-core`; per round, the
same seeded gamma schedule (`mix` lengths, shape 0.25: a coefficient of variation of 2) sent straight to it twice:
with the API server's threads on the engine's core ("shared") and on `--other-core` ("apart"), the engine's
processes staying where they are. Per phase: client TTFT p50 (all, and the 128-token prompts), and vLLM's own
split of its TTFT (API server, queue, prefill; `bench.sim_vs_real_ttft`).

    python -m bench.frontend_core [--rate 6] [--duration 25] [--rounds 3] [--out runs/frontend_core]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PHASES = {"shared": "the API server on its engine's core (as deploy runs it)",
          "apart": "the API server on another core"}
METRICS = ("ttft_p50_ms", "short_ttft_p50_ms", "api_server_ms", "queue_ms", "prefill_ms")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (a thread gone meanwhile is skipped)."""
    import psutil

    for thread in psutil.Process(pid).threads():
        try:
            os.sched_setaffinity(thread.id, cpus)
        except ProcessLookupError:
            continue


def phase_row(name: str, round_: int, records: Sequence[dict[str, Any]], parts: dict[str, float]) -> dict[str, Any]:
    """One phase's figures from the load generator's records and vLLM's TTFT split (`ttft_parts`, seconds)."""
    ok = [r for r in records if r.get("ok") and r.get("ttft_s") is not None]
    if not ok:
        raise ValueError(f"phase {name} round {round_}: no request got a first token")
    ttft = [r["ttft_s"] for r in ok]
    short = [r["ttft_s"] for r in ok if r.get("requested_prompt_tokens") == 128] or [float("nan")]
    return {"phase": name, "round": round_, "requests": len(ok), "failed": len(records) - len(ok),
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "short_ttft_p50_ms": 1e3 * statistics.median(short),
            "api_server_ms": 1e3 * (parts["engine_ttft_s"] - parts["queue_s"] - parts["prefill_s"]),
            "queue_ms": 1e3 * parts["queue_s"], "prefill_ms": 1e3 * parts["prefill_s"]}


def summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per metric, each phase's median over the rounds and, round by round, shared over apart."""
    by = {p: {r["round"]: r for r in rows if r["phase"] == p} for p in PHASES}
    rounds = sorted(set(by["shared"]) & set(by["apart"]))
    if not rounds:
        return ["no round has both phases"]
    lines = [f"{len(rounds)} rounds; medians over them (ms), and shared / apart round by round:"]
    for m in METRICS:
        shared, apart = (statistics.median(by[p][k][m] for k in rounds) for p in PHASES)
        ratios = ", ".join(f"{by['shared'][k][m] / by['apart'][k][m]:.2f}" if by["apart"][k][m] > 0 else "-"
                           for k in rounds)
        lines.append(f"  {m}: shared {shared:.1f}, apart {apart:.1f}; shared / apart {ratios}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.frontend_core", description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s (6: about 80%% of one replica here)")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of schedule a phase (25)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-core", type=int, default=0)
    parser.add_argument("--other-core", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/frontend_core"))
    args = parser.parse_args(argv)
    usable = os.sched_getaffinity(0)
    if args.engine_core == args.other_core or not {args.engine_core, args.other_core} <= usable:
        parser.error(f"--engine-core and --other-core must be two different cores of {sorted(usable)}")
    if args.rounds < 1 or not args.rate > 0 or not args.duration > 0:
        parser.error("--rounds, --rate and --duration must be positive")

    import psutil

    from deploy.hardware import Hardware
    from deploy.launch import PlanOptions, default_plan, fit_to_hardware, launches, with_models
    from deploy.models import tiny
    from deploy.ports import free_ports
    from deploy.process import VllmServer

    from .engine_speed import counters
    from .sim_vs_real import WORKLOADS, loadtest
    from .sim_vs_real_ttft import COUNTERS, ttft_parts

    args.out.mkdir(parents=True, exist_ok=True)
    # the replica `deploy up --model tiny` would start on this one core: its settings, flags and environment
    hardware = Hardware(gpus=(), cpus=(args.engine_core,))
    plan = default_plan(PlanOptions(model="tiny", replicas=1, port=free_ports(2)), hardware)
    plan = fit_to_hardware(with_models(plan, {"tiny": tiny("tiny", None, None)}), hardware)
    launch = launches(plan, hardware)[0]
    model = launch.spec.model  # the tiny model's directory: its tokenizer for the load generator
    rows = []
    with VllmServer(launch.spec, args.out / "vllm.log", {**os.environ, **launch.env}, startup_timeout_s=420,
                    cpus=launch.cpus) as server:
        assert server.pid is not None
        engine = [c.pid for c in psutil.Process(server.pid).children(recursive=True)]
        for k in range(args.rounds):
            for name, cores in (("shared", {args.engine_core}), ("apart", {args.other_core})):
                pin(server.pid, cores)
                for pid in engine:
                    pin(pid, {args.engine_core})
                before = counters([server.url], COUNTERS)
                out = args.out / f"{name}-{k}"
                loadtest(["--host", server.url, *WORKLOADS["mix"], "--arrival", "gamma", "--burstiness", "0.25",
                          "--rate", f"{args.rate:g}", "--duration", f"{args.duration:g}", "--seed", str(k),
                          "--prompt-salt", str(1000 + k), "--tokenizer", model], out, args.duration + 600)
                parts = ttft_parts(before, counters([server.url], COUNTERS))
                records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line]
                rows.append(phase_row(name, k, records, parts))
                print(json.dumps(rows[-1]), flush=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(summary_lines(rows)))


if __name__ == "__main__":
    main()
