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

from deploy.plan import PlanError
from deploy.process import ProcessError
from planner.choice import BcaConfig, ChoiceConfig, Slo
from planner.client import Timeouts
from planner.errors import PlannerError, RunError
from planner.setup import WorkloadOptions

logger = logging.getLogger(__name__)


def _plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="choose B*, memory per replica and replica count; write plan.yaml",
                       description="Plan a deployment from a profile directory or a reference-format CSV.")
    p.add_argument("--profile", required=True, type=Path, help="directory from `planner profile`, or a CSV")
    p.add_argument("--out", type=Path, default=Path("plan.yaml"), help="the plan to write (default plan.yaml)")
    p.add_argument("--epsilon", type=float, default=0.05, help="B* is within this of the best (default 0.05)")
    p.add_argument("--slo-p99-tpot-ms", type=float, help="only batch sizes whose p99 TPOT is at most this")
    p.add_argument("--slo-p99-ttft-ms", type=float, help="only batch sizes whose p99 TTFT is at most this")
    p.add_argument("--slo-p99-itl-ms", type=float, help="only batch sizes whose p99 ITL is at most this")
    p.add_argument("--model", help="model to serve (default: the profile's)")
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
    p.add_argument("--policy", default="least_outstanding_tokens", help="the gateway's routing policy")
    p.add_argument("--queue-size", type=int, help="gateway admission queue (default max(1024, 4 x replicas x B*))")
    p.add_argument("--bca-efficiency", type=float, default=0.1, help="BCA comparison: efficiency threshold (0.1)")
    p.add_argument("--bca-latency-factor", type=float, default=3.0, help="BCA comparison: L (default 3)")
    p.add_argument("--plots", type=Path, help="also draw the profile's plots into this directory")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from deploy.plan import dump
    from planner.planning import PlanConfig, make_plan
    from planner.sources import load_profile

    config = PlanConfig(
        choice=ChoiceConfig(epsilon=args.epsilon, slo=Slo(p99_tpot_ms=args.slo_p99_tpot_ms,
                                                          p99_ttft_ms=args.slo_p99_ttft_ms,
                                                          p99_itl_ms=args.slo_p99_itl_ms)),
        bca=BcaConfig(min_efficiency=args.bca_efficiency, latency_factor=args.bca_latency_factor),
        model=args.model, device=args.device, gpu_memory_gib=args.gpu_memory_gib,
        usable_fraction=args.usable_fraction, weights_gib=args.weights_gib,
        kv_bytes_per_token=args.kv_bytes_per_token, tokens_per_request=args.tokens_per_request,
        block_size=args.block_size, overhead_gib=args.overhead_gib, margin=args.margin, replicas=args.replicas,
        max_replicas=args.max_replicas, kv_cache_bytes_mode=args.kv_cache_bytes, base_port=args.base_port,
        gateway_port=args.gateway_port, policy=args.policy, queue_size=args.queue_size)
    profile = load_profile(args.profile)
    plan = make_plan(profile, config)
    try:
        dump(plan, args.out)
    except OSError as exc:
        raise PlannerError(f"cannot write the plan to {str(args.out)!r}: {exc.strerror}") from exc
    print(plan.reasoning["summary"])
    print(plan.reasoning["bca"]["explanation"])
    for warning in plan.reasoning["warnings"]:
        print(f"warning: {warning}")
    print(f"wrote {args.out}")
    if args.plots is not None:
        from planner.plots import plot_profile
        for path in plot_profile(profile, args.plots, plan):
            print(f"wrote {path}")
    return 0


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers like 1,2,4,8; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers; got {text!r}")
    return sizes


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, help="requests per point (default: 4 x B, at least 32)")
    p.add_argument("--input-tokens", type=int, default=512, help="fixed workload: prompt tokens (512)")
    p.add_argument("--output-tokens", type=int, default=256, help="fixed workload: output tokens (256)")
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
    target.add_argument("--model", help="launch vLLM with this model for each point")
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
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before each point (2)")
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
                          timeouts=Timeouts(request_s=args.request_timeout), dry_run=args.dry_run)
    command = ProfileCommand(sweep=sweep, workload=_workload_options(args), model=args.model, url=args.url,
                             vllm_args=tuple(shlex.split(args.vllm_args)), port=args.port,
                             cpu_kvcache_space_gib=args.cpu_kvcache_space_gib,
                             startup_timeout_s=args.startup_timeout, device=args.device, gpu_index=args.gpu_index)
    profiler = build_profiler(command)
    files = profiler.run()
    if not args.dry_run:
        print(f"{len(files)} point(s) in {args.out}; next: planner plan --profile {args.out} --out plan.yaml")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planner", description="Profile one vLLM instance, plan replicas on "
                                     "one device, and validate the plan.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _PARSERS:
        add(sub)
    return parser


_PARSERS: list[Callable[[argparse._SubParsersAction], None]] = [_profile_parser, _plan_parser]  # type: ignore[type-arg]


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
