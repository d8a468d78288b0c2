"""`deploy up | status | down | tiny-model`: flags → frozen config → the deployment."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from deploy import state as run_state
from deploy.hardware import Hardware, detect
from deploy.launch import DEFAULT_MODEL, DEFAULT_PORT, DEFAULT_REPLICAS, PlanOptions, default_plan, fit_to_hardware, \
    launches, with_models
from deploy.models import ModelError, ResolvedModel, resolve
from deploy.plan import Plan, PlanError, load
from deploy.process import REPLICA_NICE, StopFlag
from deploy.rolling import RollingConfig, RollingError, rolling_restart
from deploy.tinylora import ensure_tiny_adapter
from deploy.tinymodel import default_cache_dir, ensure_tiny_model
from deploy.up import DeployError, UpConfig, run
from gateway.config import DEFAULT_POLICY, POLICY_NAMES

logger = logging.getLogger(__name__)



def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deploy", description="Run vLLM replicas behind the smallserve gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the replicas and the gateway; stay in the foreground",
                        description="Start N vLLM replicas (on a GPU one after another, on CPU at once), then the "
                                    "gateway, and keep them running until Ctrl-C or SIGTERM. Arguments after `--` "
                                    "go to every replica.")
    up.add_argument("--plan", metavar="FILE", help="a plan written by `planner plan`")
    up.add_argument("--replicas", type=int, help=f"number of replicas without a plan (default {DEFAULT_REPLICAS})")
    up.add_argument("--model", help=f"HF model id, local path, synthetic:NAME (a real architecture, random weights; "
                    f"e.g. synthetic:opt-1.3b) or `tiny` (default {DEFAULT_MODEL})")
    up.add_argument("--port", type=int, help=f"the gateway's port (default {DEFAULT_PORT}, or the plan's)")
    up.add_argument("--host", default="0.0.0.0", help="the gateway's listen address (default 0.0.0.0)")
    up.add_argument("--replica-port-base", type=int, help="first replica's port without a plan (default port+1)")
    up.add_argument("--max-num-seqs", type=int, help="vLLM batch cap per replica (default 128 GPU, 32 CPU)")
    up.add_argument("--max-model-len", type=int, help="context length per replica (default: the model's)")
    up.add_argument("--gpu-memory-utilization", type=float, help="GPU share per replica (default 0.9/N)")
    up.add_argument("--kv-cache-gib", type=float, help="CPU KV cache per replica in GiB (default 1)")
    up.add_argument("--policy", choices=POLICY_NAMES, help=f"the gateway's routing policy (default {DEFAULT_POLICY})")
    up.add_argument("--gateway-workers", type=int, metavar="N",
                    help="the gateway's worker processes (default: the plan's, from its expected token rate; else 1)")
    up.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto", help="default: GPU if pynvml sees one")
    up.add_argument("--mps", action="store_true", help="run an NVIDIA MPS control daemon for the replicas")
    up.add_argument("--run-dir", type=Path, help="state, logs and gateway config (default ~/.cache/smallserve/run)")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a replica may take to get healthy")
    up.add_argument("--silent-start-timeout", type=float, default=180.0,
                    help="a restarted replica whose log stays silent this many seconds is wedged: stopped and "
                         "started again (default 180; 0: never)")
    up.add_argument("--hub-timeout", type=float, default=5.0, help="seconds to wait for the Hugging Face hub")
    up.add_argument("--replica-nice", type=int, default=REPLICA_NICE, metavar="N",
                    help=f"run the replicas N steps below normal CPU priority, so that the gateway and clients on "
                         f"their machine come first (0-19; default {REPLICA_NICE}; 0: same as the gateway)")
    up.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    up.add_argument("--admin-key", help="the gateway's admin API key (default: a new random one, written to "
                    "RUN_DIR/admin.key)")
    up.add_argument("--max-loras", type=int, metavar="N",
                    help="serve LoRA adapters: each replica holds up to N at once (vLLM --enable-lora --max-loras)")
    up.add_argument("--max-lora-rank", type=int, metavar="R", help="the largest adapter rank (vLLM's default 16)")
    up.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                    help="register a LoRA adapter the gateway loads on demand (a directory or a Hugging Face "
                         "repository); repeatable; needs --max-loras (default 1 when given)")
    up.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS", help="extra arguments for every replica")
    status = sub.add_parser("status", help="show the running deployment's replicas and gateway")
    status.add_argument("--run-dir", type=Path)
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    down = sub.add_parser("down", help="stop the deployment running with this run directory (SIGTERM)")
    down.add_argument("--run-dir", type=Path)
    down.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop")
    restart = sub.add_parser("restart", help="restart the replicas one at a time without failing a request",
                             description="Drain a replica in the gateway, restart it, add it back once healthy; "
                                         "then the next one.")
    restart.add_argument("--rolling", action="store_true", required=True,
                         help="one replica at a time (the only way there is: the others serve meanwhile)")
    restart.add_argument("--run-dir", type=Path)
    restart.add_argument("--drain-timeout", type=float, default=300.0,
                         help="seconds a replica's requests may take to finish (default 300)")
    restart.add_argument("--startup-timeout", type=float, default=600.0,
                         help="seconds a restarted replica may take to get healthy (default 600)")
    restart.add_argument("--replica", action="append", default=[], metavar="NAME",
                         help="restart only this replica (repeat for several; default: every one)")
    tiny = sub.add_parser("tiny-model", help="make (once) the tiny offline model and print its directory")
    tiny.add_argument("--dir", type=Path, help="where (default ~/.cache/smallserve/models/tiny-opt)")
    tiny_lora = sub.add_parser("tiny-lora", help="make (once) LoRA adapters for the tiny model; print NAME=PATH "
                               "for each (as --lora takes them)")
    tiny_lora.add_argument("names", nargs="+", metavar="NAME")
    tiny_lora.add_argument("--dir", type=Path, help="where (default ~/.cache/smallserve/loras)")
    return parser


def lora_options(args: argparse.Namespace) -> tuple[int | None, int | None, tuple[tuple[str, str], ...]]:
    """--max-loras, --max-lora-rank and the --lora NAME=PATH registry, checked."""
    adapters = []
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=PATH, got {item!r}")
        adapters.append((name, path))
    max_loras = args.max_loras if args.max_loras is not None else (1 if adapters else None)
    if max_loras is not None and max_loras < 1:
        raise ValueError(f"--max-loras must be a positive integer, got {max_loras!r}")
    if args.max_lora_rank is not None and max_loras is None:
        raise ValueError("--max-lora-rank needs --max-loras (or --lora)")
    return max_loras, args.max_lora_rank, tuple(adapters)


def build_plan(args: argparse.Namespace, hardware: Hardware) -> Plan:
    """The plan file (with --port, --policy, LoRA and extra vLLM arguments applied) or a plan from the flags."""
    plan = _plan(args, hardware)
    max_loras, rank, adapters = lora_options(args)
    if max_loras is None:
        return plan
    replicas = tuple(replace(r, max_loras=max_loras, max_lora_rank=rank or r.max_lora_rank) for r in plan.replicas)
    return replace(plan, replicas=replicas, adapters={**plan.adapters, **dict(adapters)})


def _plan(args: argparse.Namespace, hardware: Hardware) -> Plan:
    if args.plan:
        clashing = [f"--{name.replace('_', '-')}" for name in ("replicas", "model", "replica_port_base",
                    "max_num_seqs", "max_model_len", "gpu_memory_utilization", "kv_cache_gib")
                    if getattr(args, name) is not None]
        if clashing:
            raise PlanError(f"{', '.join(clashing)} cannot be combined with --plan (the plan says)")
        plan = load(args.plan)
        gateway = replace(plan.gateway, port=args.port if args.port is not None else plan.gateway.port,
                          policy=args.policy or plan.gateway.policy,
                          workers=plan.gateway.workers if args.gateway_workers is None else args.gateway_workers)
        replicas = tuple(replace(r, extra_args=(*r.extra_args, *args.vllm_args)) for r in plan.replicas)
        return replace(plan, gateway=gateway, replicas=replicas)  # validated again: ports must not collide
    options = PlanOptions(
        model=args.model or DEFAULT_MODEL, replicas=args.replicas or DEFAULT_REPLICAS,
        port=args.port if args.port is not None else DEFAULT_PORT, replica_port_base=args.replica_port_base,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, cpu_kvcache_space_gib=args.kv_cache_gib,
        policy=args.policy or DEFAULT_POLICY, extra_args=tuple(args.vllm_args))
    plan = default_plan(options, hardware)
    return replace(plan, gateway=replace(plan.gateway, workers=1 if args.gateway_workers is None else args.gateway_workers))


def resolve_models(plan: Plan, hub_timeout_s: float) -> dict[str, ResolvedModel]:
    """Resolve every model the plan names once, saying so when the tiny model stands in."""
    resolved = {}
    for name in dict.fromkeys(spec.model for spec in plan.replicas):
        model = resolve(name, timeout_s=hub_timeout_s)
        if model.fallback_reason:
            print(f"deploy: {model.fallback_reason}.\ndeploy: using the tiny offline model instead "
                  f"({model.source}, served as {model.served_name!r}): random weights, it answers nonsense.",
                  file=sys.stderr, flush=True)
        resolved[name] = model
    return resolved


def build_up_config(args: argparse.Namespace) -> UpConfig:
    for name in ("startup_timeout", "hub_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)!r}")
    if args.silent_start_timeout < 0:
        raise ValueError(f"--silent-start-timeout must be 0 (off) or positive, got {args.silent_start_timeout!r}")
    if not 0 <= args.replica_nice <= 19:
        raise ValueError(f"--replica-nice must be 0-19, got {args.replica_nice!r}")
    hardware = detect(args.device)
    plan = build_plan(args, hardware)
    resolved = resolve_models(plan, args.hub_timeout)
    plan = fit_to_hardware(with_models(plan, resolved, gpu=bool(hardware.gpus)), hardware)
    label = ", ".join(sorted({r.served_name or r.source for r in resolved.values()}))
    if args.mps and not hardware.gpus:
        print("deploy: --mps ignored: no NVIDIA GPU", file=sys.stderr)
    return UpConfig(plan=plan, launches=tuple(launches(plan, hardware)), hardware=hardware,
                    run_dir=args.run_dir or run_state.default_run_dir(), model_label=label, host=args.host,
                    mps=args.mps and bool(hardware.gpus), startup_timeout_s=args.startup_timeout,
                    silent_start_s=args.silent_start_timeout or None, replica_nice=args.replica_nice,
                    log_level=args.log_level, admin_key=args.admin_key)


def cmd_up(args: argparse.Namespace) -> int:
    stop = StopFlag()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()  # no lock, no I/O: safe in a handler

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    config = build_up_config(args)
    run(config, stop)
    if received:
        print(f"deploy: stopped on {signal.Signals(received[0]).name}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = run_state.read(args.run_dir or run_state.default_run_dir())
    running = run_state.is_running(state)
    if args.json:
        print(json.dumps({**state.to_dict(), "running": running}, indent=2))
    else:
        print(run_state.format_table(state))
    return 0 if running else 3


def cmd_down(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or run_state.default_run_dir()
    state = run_state.read(run_dir)
    if not run_state.is_running(state):
        print(f"deploy: no deployment runs with run directory {str(run_dir)!r}", file=sys.stderr)
        return 0
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while run_state.pid_alive(state.pid):
        if time.monotonic() > deadline:
            print(f"deploy: pid {state.pid} still runs {args.timeout:g} s after SIGTERM", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(f"deploy: stopped (pid {state.pid})", file=sys.stderr)
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    config = RollingConfig(args.run_dir or run_state.default_run_dir(), drain_timeout_s=args.drain_timeout,
                           start_timeout_s=args.startup_timeout, only=tuple(dict.fromkeys(args.replica)))
    try:
        rolling_restart(config, lambda line: print(line, file=sys.stderr, flush=True))
    except RollingError as exc:
        print(f"deploy restart: {exc}", file=sys.stderr)
        return 1
    print(f"deploy: {', '.join(config.only) if config.only else 'every replica'} restarted", file=sys.stderr)
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    print(ensure_tiny_model(args.dir))
    return 0


def cmd_tiny_lora(args: argparse.Namespace) -> int:
    model = ensure_tiny_model()
    where = args.dir or default_cache_dir() / "loras"
    for name in args.names:
        print(f"{name}={ensure_tiny_adapter(where / name, name, str(model))}")
    return 0


COMMANDS = {"up": cmd_up, "status": cmd_status, "down": cmd_down, "restart": cmd_restart,
            "tiny-model": cmd_tiny_model, "tiny-lora": cmd_tiny_lora}


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = COMMANDS[args.command](args)
    except (PlanError, ModelError, DeployError, run_state.StateError, ValueError) as exc:
        print(f"deploy {args.command}: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
