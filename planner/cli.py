"""`planner profile | plan | validate | plot`: flags -> frozen config -> components.

User mistakes (bad flags, unreadable profiles, nothing meets the SLOs) print `planner: <message>` on stderr and
exit 2, without a traceback; a replica that dies or a run that fails exits 1.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from deploy.plan import Plan, PlanError
from gateway.config import DEFAULT_POLICY, POLICY_NAMES
from deploy.process import ProcessError
from planner.choice import BcaConfig, ChoiceConfig, Slo
from planner.client import Timeouts
from planner.errors import PlannerError, RunError
from planner.points import Profile
from planner.setup import WorkloadOptions

logger = logging.getLogger(__name__)


def _add_choice_flags(p: argparse.ArgumentParser) -> None:
    """How B* is chosen, and the BCA rule's knobs for the comparison."""
    p.add_argument("--epsilon", type=float, default=0.05, help="B* is within this of the best (default 0.05)")
    p.add_argument("--slo-p99-tpot-ms", type=float, help="only batch sizes whose p99 TPOT is at most this")
    p.add_argument("--slo-p99-ttft-ms", type=float, help="only batch sizes whose p99 TTFT is at most this")
    p.add_argument("--slo-p99-itl-ms", type=float, help="only batch sizes whose p99 ITL is at most this")
    p.add_argument("--bca-efficiency", type=float, default=0.1, help="BCA comparison: efficiency threshold (0.1)")
    p.add_argument("--bca-latency-factor", type=float, default=3.0, help="BCA comparison: L (default 3)")


def _bca_config(args: argparse.Namespace) -> BcaConfig:
    return BcaConfig(min_efficiency=args.bca_efficiency, latency_factor=args.bca_latency_factor)


def _plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="choose B*, memory per replica and replica count; write plan.yaml",
                       description="Plan a deployment from a profile directory or a reference-format CSV; or, "
                                   "with --models, several models with their own traffic on one device.")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--profile", type=Path, help="directory from `planner profile`, or a CSV")
    target.add_argument("--models", type=Path, help="several models on one device: a YAML file of models, each "
                        "with its profile (or synthetic:NAME), traffic and goal (docs/multimodel.md)")
    p.add_argument("--out", type=Path, default=Path("plan.yaml"), help="the plan to write (default plan.yaml)")
    _add_choice_flags(p)
    p.add_argument("--model", help="model to serve (default: the profile's); synthetic:NAME for a shipped "
                   "architecture with random weights (its size comes from its config.json)")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="gpu: split GPU memory; cpu: size VLLM_CPU_KVCACHE_SPACE (auto: from the profile/flags)")
    p.add_argument("--gpu-memory-gib", type=float, help="GPU memory (default: measured by the profile)")
    p.add_argument("--usable-fraction", type=float, default=0.9,
                   help="share of the GPU all replicas together may use (default 0.9, vLLM's default)")
    p.add_argument("--weights-gib", type=float, help="model weights (default: the profile's or the files' size)")
    p.add_argument("--kv-bytes-per-token", type=float,
                   help="KV bytes per token (default: measured, else from the model's config.json)")
    p.add_argument("--tokens-per-request", type=int, help="input + output tokens (default: the profile's workload)")
    p.add_argument("--block-size", type=int, help="KV block size in tokens (default: measured, else 16)")
    p.add_argument("--overhead-gib", type=float, help="runtime overhead per replica (default: measured, else 1)")
    p.add_argument("--margin", type=float, default=0.10, help="safety margin on each replica's slice (0.10)")
    p.add_argument("--replicas", type=int, help="exactly this many replicas (GPU: must fit; CPU default 2)")
    p.add_argument("--max-replicas", type=int, help="at most this many replicas")
    p.add_argument("--kv-cache-bytes", action="store_true",
                   help="give each replica kv_cache_memory_bytes instead of gpu_memory_utilization")
    p.add_argument("--base-port", type=int, default=8001, help="first replica's port (default 8001)")
    p.add_argument("--gateway-port", type=int, default=8000, help="the gateway's port (default 8000)")
    p.add_argument("--policy", choices=POLICY_NAMES, default=DEFAULT_POLICY,
                   help="the gateway's routing policy")
    p.add_argument("--queue-size", type=int, help="gateway admission queue (default max(1024, 4 x replicas x B*))")
    p.add_argument("--max-loras", type=int, help="serve LoRA adapters: slots per replica (counted in memory; "
                   "vLLM --enable-lora --max-loras)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (default 16, vLLM's)")
    p.add_argument("--lora-gib", type=float, help="one replica's LoRA slots (default: from the model's config.json)")
    p.add_argument("--plots", type=Path, help="also draw the profile's plots into this directory")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from planner.planning import PlanConfig, make_plan, write_plan
    from planner.sources import load_profile

    if args.models is not None:
        return _run_multi_plan(args)
    config = PlanConfig(
        choice=_choice_config(args),
        bca=_bca_config(args),
        model=args.model, device=args.device, gpu_memory_gib=args.gpu_memory_gib,
        usable_fraction=args.usable_fraction, weights_gib=args.weights_gib,
        kv_bytes_per_token=args.kv_bytes_per_token, tokens_per_request=args.tokens_per_request,
        block_size=args.block_size, overhead_gib=args.overhead_gib, margin=args.margin, replicas=args.replicas,
        max_replicas=args.max_replicas, kv_cache_bytes_mode=args.kv_cache_bytes, base_port=args.base_port,
        gateway_port=args.gateway_port, policy=args.policy, queue_size=args.queue_size, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, lora_gib=args.lora_gib)
    profile = load_profile(args.profile)
    plan = make_plan(profile, config)
    write_plan(plan, args.out)
    print(plan.reasoning["summary"])
    print(plan.reasoning["bca"]["explanation"])
    for warning in plan.reasoning["warnings"]:
        print(f"warning: {warning}")
    print(f"wrote {args.out}")
    if args.plots is not None:
        _draw(profile, args.plots, config.choice, config.bca)
    return 0


def _run_multi_plan(args: argparse.Namespace) -> int:
    from planner.multimodel import load_spec
    from planner.multiplan import make_multi_plan
    from planner.planning import write_plan

    result = make_multi_plan(load_spec(args.models))
    write_plan(result.plan, args.out)
    print(result.plan.reasoning["summary"])
    baselines = result.plan.reasoning["multimodel"]["baselines"]
    print(f"least headroom: packed {result.packing.min_headroom:.2f} x, equal split "
          f"{baselines['equal_split']['min_headroom']:.2f} x, one replica each at the default share "
          f"{baselines['one_replica_each']['min_headroom']:.2f} x (predicted)")
    print(f"wrote {args.out}")
    return 0


def _draw(profile: Profile, directory: Path, choice: ChoiceConfig, bca: BcaConfig) -> None:
    from planner.choice import bca_choice, choose_batch
    from planner.plots import plot_profile

    for path in plot_profile(profile, directory, choose_batch(profile.points, choice), bca_choice(profile.points, bca)):
        print(f"wrote {path}")


def _plot_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plot", help="draw a profile's pictures (frontier with B*, GPU) without planning",
                       description="Draw frontier.png (and gpu.png when measured) for a profile or a CSV.")
    p.add_argument("--profile", required=True, type=Path, help="directory from `planner profile`, or a CSV")
    p.add_argument("--out", type=Path, default=Path("."), help="directory for the PNG files (default .)")
    _add_choice_flags(p)
    p.set_defaults(run=_run_plot)


def _choice_config(args: argparse.Namespace) -> ChoiceConfig:
    return ChoiceConfig(epsilon=args.epsilon, slo=Slo(p99_tpot_ms=args.slo_p99_tpot_ms,
                                                      p99_ttft_ms=args.slo_p99_ttft_ms,
                                                      p99_itl_ms=args.slo_p99_itl_ms))


def _run_plot(args: argparse.Namespace) -> int:
    from planner.sources import load_profile

    _draw(load_profile(args.profile), args.out, _choice_config(args), _bca_config(args))
    return 0


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers like 1,2,4,8; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers; got {text!r}")
    return sizes


def _add_workload_flags(p: argparse.ArgumentParser, defaults: tuple[int, int] | None = (512, 256)) -> None:
    """Workload flags; validate passes no defaults, so that the plan's recorded workload applies."""
    p.add_argument("--num-requests", type=int, help="requests per run (default: 4 x the concurrency, at least 32)")
    p.add_argument("--input-tokens", type=int, default=defaults and defaults[0],
                   help="fixed workload: prompt tokens (default 512; validate: the profile's)")
    p.add_argument("--output-tokens", type=int, default=defaults and defaults[1],
                   help="fixed workload: output tokens (default 256; validate: the profile's)")
    p.add_argument("--dataset", help="a ShareGPT JSON file or a JSONL of prompts instead of fixed lengths")
    p.add_argument("--dataset-format", choices=("sharegpt", "jsonl"), help="default: by the file's extension")
    p.add_argument("--tokenizer", help="tokenizer.json (or its directory) to build exact-length prompts")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore it)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request (900)")


def _profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("profile", help="sweep the batch cap B over one vLLM instance; one JSON file per point",
                       description="Profile one vLLM instance: launched per point with --max-num-seqs B "
                                   "(--model), or already running (--url).")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", help="launch vLLM with this model for each point (a hub id, a directory, or "
                        "synthetic:NAME: a real architecture with random weights, e.g. synthetic:opt-1.3b)")
    target.add_argument("--url", help="profile this running server (B is then only the concurrency)")
    p.add_argument("--out", type=Path, required=True, help="directory for the point files (reruns skip done ones)")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=None,
                   help="B values, e.g. 1,2,4,8 (default: powers of two 1..512)")
    p.add_argument("--served-model-name", help="the model name requests carry (default: from /v1/models)")
    _add_workload_flags(p)
    p.add_argument("--vllm-args", default="", help="extra vLLM arguments, one string, e.g. '--dtype half'")
    p.add_argument("--port", type=int, default=0, help="port for launched servers (default: a free one)")
    p.add_argument("--cpu-kvcache-space-gib", type=float, help="VLLM_CPU_KVCACHE_SPACE for launched CPU servers")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for vLLM to become healthy")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="what the replica runs on (auto: gpu when NVML finds one)")
    p.add_argument("--gpu-index", type=int, default=0, help="the GPU NVML samples (0)")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics scrapes")
    p.add_argument("--warmup", type=int, help="warm-up requests before each point (default: one round, as many as "
                   "the point's batch size, sent together)")
    p.add_argument("--prompt-seed", type=int, default=0, help="another seed, other prompts: for a replica profiled "
                   "again, whose prefix cache holds the first profile's prompts (0)")
    p.add_argument("--client-processes", type=int, default=1, help="send each point's load from this many client "
                   "processes (1: from this one; each point's log line says how many cores its client used)")
    p.add_argument("--dry-run", action="store_true", help="print the runs without running them")
    p.set_defaults(run=_run_profile)


def _workload_options(args: argparse.Namespace) -> WorkloadOptions:
    return WorkloadOptions(input_tokens=args.input_tokens, output_tokens=args.output_tokens, dataset=args.dataset,
                           dataset_format=args.dataset_format, tokenizer=args.tokenizer,
                           ignore_eos=not args.no_ignore_eos)


def _run_profile(args: argparse.Namespace) -> int:
    from planner.profiler import DEFAULT_BATCH_SIZES, ProfileConfig
    from planner.setup import ProfileCommand, build_profiler

    sweep = ProfileConfig(out=args.out, batch_sizes=args.batch_sizes or DEFAULT_BATCH_SIZES,
                          num_requests=args.num_requests, warmup_requests=args.warmup,
                          model_name=args.served_model_name, metrics_interval_s=args.metrics_interval,
                          timeouts=Timeouts(request_s=args.request_timeout), dry_run=args.dry_run,
                          prompt_seed=args.prompt_seed, client_processes=args.client_processes)
    command = ProfileCommand(sweep=sweep, workload=_workload_options(args), model=args.model, url=args.url,
                             vllm_args=tuple(shlex.split(args.vllm_args)), port=args.port,
                             cpu_kvcache_space_gib=args.cpu_kvcache_space_gib,
                             startup_timeout_s=args.startup_timeout, device=args.device, gpu_index=args.gpu_index)
    profiler = build_profiler(command)
    try:
        files = profiler.run()
    finally:
        if profiler.gpu is not None:
            profiler.gpu.close()
    if not args.dry_run:
        print(f"{len(files)} point(s) in {args.out}; next: planner plan --profile {args.out} --out plan.yaml")
    return 0


def _validate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("validate", help="deploy 1..N replicas of a plan, measure each through the gateway, "
                                        "keep the best, write the comparison into the plan",
                       description="Deploy 1, 2, ... N replicas (`deploy up --plan`), drive the plan's workload "
                                   "through the gateway, and keep the best replica count.")
    p.add_argument("--plan", type=Path, required=True, help="a plan written by `planner plan`")
    p.add_argument("--out", type=Path, help="where to write the validated plan (default: over --plan)")
    p.add_argument("--counts", type=_batch_sizes, help="replica counts to try (default 1..the plan's N)")
    p.add_argument("--min-gain", type=float, default=0.05,
                   help="keep the fewest replicas within this of the best throughput (0.05)")
    p.add_argument("--run-dir", type=Path, help="deploy run directories and logs (default: beside the plan)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a replica may take to start")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before each count (2)")
    p.add_argument("--clients", type=int, default=0,
                   help="client processes that send each count's load (default 0: one per replica; 1: one for "
                        "all, which can be the limit on a fast GPU)")
    p.add_argument("--plots", type=Path, help="draw throughput and latency against replica count here")
    p.add_argument("--duration", type=float, default=60.0,
                   help="multi-model plans: seconds of mixed traffic per arrangement (60)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multi-model plans: the planned rates times this (1.0)")
    p.add_argument("--arrangements", help="multi-model plans: which to measure, comma-separated "
                   "(default packed,equal_split,one_replica_each)")
    _add_workload_flags(p, defaults=None)
    p.set_defaults(run=_run_validate)


def _run_validate(args: argparse.Namespace) -> int:
    from deploy.plan import load
    from planner.setup import build_workload
    from planner.planning import write_plan
    from planner.validate import SubprocessDeployer, ValidateConfig, Validator

    plan = load(args.plan)
    if plan.models:
        return _run_multi_validate(args, plan)
    config = ValidateConfig(counts=args.counts or tuple(range(1, len(plan.replicas) + 1)),
                            num_requests=args.num_requests, min_gain=args.min_gain, warmup_requests=args.warmup,
                            timeouts=Timeouts(request_s=args.request_timeout), clients=args.clients)
    workload = build_workload(_validate_workload(args, plan.reasoning.get("workload") or {}), plan.model)
    run_dir = args.run_dir or args.plan.resolve().parent / "validate-run"
    deployer = SubprocessDeployer(run_dir=run_dir, startup_timeout_s=args.startup_timeout)
    validated, results = Validator(plan, config, deployer, workload).run()
    out = args.out or args.plan
    write_plan(validated, out)
    best = validated.validation["best_replicas"]
    print(validated.validation["decision"])
    print(f"best: {best} replica(s) of {len(plan.replicas)} planned; wrote {out}")
    if args.plots is not None:
        from planner.plots import plot_replicas
        print(f"wrote {plot_replicas(results, best, args.plots / 'replicas.png')}")
    return 0


def _run_multi_validate(args: argparse.Namespace, plan: Plan) -> int:
    from planner.multivalidate import ARRANGEMENTS, MultiValidateConfig, MultiValidator
    from planner.planning import write_plan
    from planner.validate import SubprocessDeployer

    arrangements = tuple(a for a in (args.arrangements or ",".join(ARRANGEMENTS)).split(",") if a)
    config = MultiValidateConfig(duration_s=args.duration, scale=args.scale, arrangements=arrangements,
                                 timeouts=Timeouts(request_s=args.request_timeout))
    run_dir = args.run_dir or args.plan.resolve().parent / "validate-run"
    deployer = SubprocessDeployer(run_dir=run_dir, startup_timeout_s=args.startup_timeout)
    validated = MultiValidator(plan, config, deployer).run()
    out = args.out or args.plan
    write_plan(validated, out)
    print(f"best: {validated.validation['best']}; wrote {out}")
    return 0


def _validate_workload(args: argparse.Namespace, planned: dict[str, object]) -> WorkloadOptions:
    """Flags win; else the workload the profile used (the plan records it); else the papers' 512/256."""
    kind = planned.get("kind")
    dataset = args.dataset or (planned.get("source") if kind in ("sharegpt", "jsonl") else None)
    recorded_in, recorded_out = (planned.get("input_tokens"), planned.get("output_tokens"))
    return WorkloadOptions(
        input_tokens=args.input_tokens or (recorded_in if kind == "fixed" and isinstance(recorded_in, int) else 512),
        output_tokens=args.output_tokens or (recorded_out if isinstance(recorded_out, int) else 256),
        dataset=str(dataset) if dataset else None, dataset_format=args.dataset_format, tokenizer=args.tokenizer,
        ignore_eos=not args.no_ignore_eos)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planner", description="Profile one vLLM instance, plan replicas on "
                                     "one device, and validate the plan.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _PARSERS:
        add(sub)
    return parser


_PARSERS: list[Callable[[argparse._SubParsersAction], None]] = [_profile_parser, _plan_parser, _validate_parser, _plot_parser]  # type: ignore[type-arg]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code: int = args.run(args)
    except (PlannerError, PlanError) as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return 2
    except (RunError, ProcessError) as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
