"""`sim`: serve simulated vLLM replicas, check the calibration, or run a large experiment in virtual time.

    sim serve --model CONFIG --gpu NAME --replicas N --port P [--max-num-seqs B] [--gpu-memory-utilization F]
    sim serve --config replica.json --replicas N --port P     (a replica model from `sim calibrate --profile`)
    sim calibrate [--fit]
    sim stepfit
    sim calibrate --profile DIR --out replica.json [--max-num-seqs B ...]
    sim run --model CONFIG --gpu NAME --replicas 16 --requests 100000 --load 0.8
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from gateway.config import DEFAULT_POLICY, POLICY_NAMES

from .clock import LoopClock
from .config import ServeConfig
from .gpus import GpuSpec, get_gpu, parse_gpu_spec
from .measured import ReplicaModel
from .model import load_model
from .node import Node, NodeSpec
from .steptime import StepCost

logger = logging.getLogger(__name__)


class UsageError(ValueError):
    """A bad command-line value; the message names it."""


def _add_node_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--model", required=model_required, help="a HF config.json, a directory holding one, or a shipped "
                   "architecture as NAME or synthetic:NAME (opt-125m, opt-1.3b, opt-2.7b, qwen3-0.6b, qwen3-1.7b, "
                   "llama-3.2-1b, llama-3.2-3b, gemma-3-1b, smollm2-135m)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", default="H100-80GB", help="A100-40GB, H100-64GB, H100-80GB, H200, L4 (default H100-80GB)")
    gpu.add_argument("--gpu-spec", help="a GPU not in the table: memory_gib=48,bandwidth_gbps=864,tflops=181")
    p.add_argument("--replicas", type=int, default=1, help="replicas sharing the GPU (1)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="batch cap per replica (256)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (vLLM's default)")
    p.add_argument("--gpu-memory-utilization", type=float, help="memory fraction per replica (0.9/replicas)")
    p.add_argument("--enable-chunked-prefill", action="store_true", help="V1-style chunked prefill scheduling")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="automatic prefix caching (16-token blocks of the prompt text, LRU eviction)")
    p.add_argument("--step-cost", choices=("reference", "fitted"), default="reference",
                   help="how a step is priced: reference, the papers' OPT-1.3B on an H100 64 GB with vLLM 0.5.2 "
                        "(docs/sim.md, calibration); fitted, `sim stepfit`'s constants for this GPU, fitted on all "
                        "its public and measured steps, the host time by the model's layers (a GPU without data: "
                        "the H100 80 GB's, bandwidth scaled)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sim", description="Simulated vLLM replicas sharing one GPU")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve N OpenAI-compatible simulated replicas on ports P..P+N-1")
    _add_node_flags(serve, model_required=False)
    serve.add_argument("--config", help="a replica model written by `sim calibrate --profile` (instead of --model): "
                       "replicas that imitate the profiled one")
    serve.add_argument("--port", type=int, default=8000, help="first replica's port (8000)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    serve.add_argument("--served-model-name", help="model name the API uses (default: the config's)")
    serve.add_argument("--tokenizer", help="with --config: the served model's tokenizer.json or its directory, in "
                       "place of the one the replica model names (a path on the machine it was calibrated on)")
    serve.add_argument("--seed", type=int, default=0, help="seed for simulated EOS positions")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    cal = sub.add_parser("calibrate", help="compare the simulator with the reference (and optionally refit)")
    cal.add_argument("--fit", action="store_true", help="refit the three step-time constants first (minutes)")
    cal.add_argument("--profile", metavar="DIR", action="append", help="fit a replica model to this `planner "
                     "profile` of a real replica instead, and write it to --out; a profile with longer "
                     "requests adds how a step grows with the context; more profiles of one workload are rounds "
                     "(each point: the round with the median TPOT)")
    cal.add_argument("--out", metavar="FILE", help="with --profile: where to write the replica model (JSON)")
    cal.add_argument("--max-num-seqs", type=int, help="the profiled replica's batch cap (if not in the profile)")
    cal.add_argument("--max-num-batched-tokens", type=int, help="its token budget per step (if not in the profile)")
    cal.add_argument("--max-model-len", type=int, help="its context length (if not in the profile)")
    cal.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                     help="whether it chunks prefills (vLLM V1: yes)")
    cal.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                     help="whether it caches prefixes (vLLM V1: yes unless disabled)")
    cal.add_argument("--tokenizer", help="the served model's tokenizer.json or its directory")
    cal.add_argument("--served-model-name", help="the model name its API serves")
    cal.add_argument("--frontend-on-core", action="store_true", help="the profiled replica's API server shared "
                     "its engine's core (a CPU replica confined to one core, as `deploy up` runs one): the "
                     "simulated replica's steps stand still while a request passes its front end")
    cal.add_argument("--frontend-latency", action="store_true", help="fit the front end as serial work per request "
                     "plus a latency requests spend side by side (the GPU benchmark does; a CPU replica's model, "
                     "judged on the sim-vs-real grid, keeps serial work alone)")
    cal.add_argument("--core-work", action="store_true", help="a CPU replica whose processes share one core: each "
                     "request takes the core for its front end and then for more work (its way through the engine "
                     "core, its response's way out), fitted; the steps netted of it; the prefill per token as "
                     "--prefill-cost measured it (needs it; implies --frontend-on-core)")
    cal.add_argument("--way-out", metavar="MS,MS_PER_STREAM", help="each streamed chunk's way from the engine's "
                     "output to its client, past vLLM's TTFT stamp: milliseconds, and milliseconds more per other "
                     "stream the API server is sending (bench.burst_probe --background measures it; on vLLM-CPU "
                     "about 1.6,0.5); the fit takes it as given")
    cal.add_argument("--prefill-cost", metavar="FILE", help="`python -m bench.prefill_cost --out FILE` of the same "
                     "replica: what a prefill's attention costs per (query, key) pair, so a prompt's uncached end "
                     "costs more after a long cached context")
    run = sub.add_parser("run", help="a large experiment in virtual time: Poisson arrivals, gateway routing")
    _add_node_flags(run)
    run.add_argument("--requests", type=int, default=100_000)
    run.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of capacity (0.8)")
    run.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICY_NAMES)
    run.add_argument("--seed", type=int, default=0)
    fit = sub.add_parser("stepfit", help="fit the step-time model to public GPU measurements; held-out errors")
    fit.add_argument("--data", help="folder of the step data (default planner/data/stepdata)")
    fit.add_argument("--host-fixed", action="store_true",
                     help="one fixed host time a step for every model (by default it grows with the model's layers)")
    return parser


def _gpu(args: argparse.Namespace) -> GpuSpec:
    try:
        return parse_gpu_spec(args.gpu_spec) if args.gpu_spec else get_gpu(args.gpu)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def node_spec(args: argparse.Namespace) -> NodeSpec:
    try:
        model, gpu = load_model(args.model), _gpu(args)
        cost = StepCost()
        if args.step_cost == "fitted":
            from .stepfit import fitted_cost

            cost, origin = fitted_cost(gpu, model)
            logger.info("step cost for %s on %s: %s (%s)", model.name, gpu.name, cost, origin)
        spec = NodeSpec(model, gpu, args.replicas, args.max_num_seqs, args.gpu_memory_utilization,
                        args.max_num_batched_tokens, args.enable_chunked_prefill, cost, args.enable_prefix_caching)
        spec.engine_config()  # sizes the KV cache: fails here, with the reason, when the model does not fit
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return spec


def serve_config(args: argparse.Namespace) -> ServeConfig:
    spec = node_spec(args)
    try:
        return ServeConfig(spec.model, spec.gpu, args.replicas, args.port, args.host, args.served_model_name,
                           args.max_num_seqs, args.max_num_batched_tokens, args.gpu_memory_utilization,
                           args.enable_chunked_prefill, spec.cost, args.seed, args.log_level,
                           args.enable_prefix_caching)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def node_for(config: ServeConfig, clock: LoopClock) -> Node:
    spec = NodeSpec(config.model, config.gpu, config.replicas, config.max_num_seqs, config.utilization,
                    config.max_num_batched_tokens, config.chunked_prefill, config.cost, config.prefix_caching)
    return Node(spec, clock)


async def serve_until_stopped(apps: list[web.Application], host: str, port: int, announce: str) -> None:
    """Serve each app on its own port from `port` up, log `announce`, and run until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    runners = []
    try:
        for i, app in enumerate(apps):
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, host, port + i).start()
            runners.append(runner)
        logger.info("%s", announce)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()


async def serve(config: ServeConfig) -> None:
    """Run the replicas until SIGINT/SIGTERM."""
    from .server import make_app

    node = node_for(config, LoopClock(asyncio.get_running_loop()))
    cfg = node.engine_config
    announce = (f"{config.replicas} simulated replica(s) of {config.model_name} on one {config.gpu.name} at "
                f"http://{config.host}:{config.port}..{config.port + config.replicas - 1}: {cfg.num_gpu_blocks} KV "
                f"blocks each, max_num_seqs {cfg.max_num_seqs}")
    await serve_until_stopped([make_app(engine, config.model_name, config.seed + i)
                               for i, engine in enumerate(node.engines)], config.host, config.port, announce)


def _calibrate(args: argparse.Namespace) -> None:
    from .calibrate import compare, fit, format_table

    if args.profile:
        _calibrate_profile(args)
        return
    cost = StepCost()
    if args.fit:
        cost = fit(cost)
        print(f"fitted: {cost}")
    print(format_table(compare(cost), cost))


def way_out_arg(text: str) -> tuple[float, float]:
    """`--way-out MS,MS_PER_STREAM` in seconds."""
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        base, per_stream = (float(p) / 1e3 for p in parts)
    except ValueError:
        raise UsageError(f"--way-out takes MS,MS_PER_STREAM (two numbers, e.g. 1.6,0.5), got {text!r}") from None
    if base < 0 or per_stream < 0:
        raise UsageError(f"--way-out must be >= 0, got {text!r}")
    return base, per_stream


def _calibrate_profile(args: argparse.Namespace) -> None:
    from .fromprofile import CalibrationError, EngineFacts, calibrate, format_fit

    if not args.out:
        raise UsageError("--profile needs --out FILE for the replica model")
    given = EngineFacts(args.max_num_seqs, args.max_num_batched_tokens, args.chunked_prefill, args.prefix_caching,
                        args.max_model_len, args.tokenizer, args.served_model_name)
    way_out = way_out_arg(args.way_out) if args.way_out else None
    try:
        model, rows = calibrate(args.profile[0], given, extra=args.profile[1:], frontend_on_core=args.frontend_on_core,
                                prefill_cost=args.prefill_cost, frontend_latency=args.frontend_latency,
                                core_work=args.core_work, way_out=way_out)
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    Path(args.out).write_text(model.to_json(), encoding="utf-8")
    print(format_fit(model, rows))
    print(f"replica model -> {args.out}; serve it: sim serve --config {args.out} --replicas N --port P")


async def serve_measured(model: ReplicaModel, replicas: int, port: int, host: str, seed: int,
                         tokenizer: str | None) -> None:
    """Replicas imitating a calibrated real one, until SIGINT/SIGTERM; prompt tokens counted with `tokenizer` (none:
    estimated)."""
    from .measured import FrontEnd
    from .node import MeasuredSpec
    from .server import HFCoder, make_app

    coder = HFCoder(tokenizer) if tokenizer else None
    _, _, engines = MeasuredSpec(model, replicas).build(LoopClock(asyncio.get_running_loop()))
    announce = (f"{replicas} replica(s) imitating {model.model_name} ({model.source.get('profile', '?')}) at "
                f"http://{host}:{port}..{port + replicas - 1}")
    apps = [make_app(engine, model.model_name, seed + i, coder, FrontEnd.of_model(engine, model))
            for i, engine in enumerate(engines)]
    await serve_until_stopped(apps, host, port, announce)


def _serve(args: argparse.Namespace) -> None:
    import uvloop

    if args.config:
        from .measured import ConfigError

        if args.model:
            raise UsageError("give --model or --config, not both")
        if args.replicas < 1 or not 0 < args.port <= 65535 - args.replicas + 1:
            raise UsageError(f"--replicas {args.replicas} from --port {args.port} is out of range")
        try:
            model = ReplicaModel.load(args.config)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        tokenizer = args.tokenizer or model.tokenizer
        if tokenizer and not Path(tokenizer).exists():
            where = "--tokenizer" if args.tokenizer else f"{args.config}'s tokenizer (where it was calibrated)"
            raise UsageError(f"{where}: {tokenizer} does not exist; give --tokenizer with the served model's "
                             "tokenizer.json or its directory (the tiny model's: `deploy tiny-model` prints it)")
        uvloop.run(serve_measured(model, args.replicas, args.port, args.host, args.seed, tokenizer))
        return
    if not args.model:
        raise UsageError("serve needs --model (a simulated architecture) or --config (a calibrated replica)")
    uvloop.run(serve(serve_config(args)))


def _run(args: argparse.Namespace) -> None:
    from .fleet import run_open_loop

    import time

    spec = node_spec(args)
    wall, cpu = time.perf_counter(), time.process_time()
    summary = run_open_loop(spec, args.requests, args.load, args.policy, args.seed)
    print(summary.report())
    print(f"{args.replicas} replicas, {args.requests:,} requests: {time.perf_counter() - wall:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} s CPU")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            _serve(args)
        elif args.command == "calibrate":
            _calibrate(args)
        elif args.command == "stepfit":
            from .stepfit import main as stepfit
            stepfit((["--data", args.data] if args.data else []) + (["--host-fixed"] if args.host_fixed else []))
        else:
            _run(args)
    except UsageError as exc:
        print(f"sim: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
