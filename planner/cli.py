"""`planner profile | plan | validate | plot`: flags -> frozen config -> components.

User mistakes (bad flags, unreadable profiles, nothing meets the SLOs) print `planner: <message>` on stderr and
exit 2, without a traceback; a replica that dies or a run that fails exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from deploy.plan import PlanError
from planner.choice import BcaConfig, ChoiceConfig, Slo
from planner.errors import PlannerError

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
    print(f"wrote {args.out}")
    if args.plots is not None:
        from planner.plots import plot_profile
        for path in plot_profile(profile, args.plots, plan):
            print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planner", description="Profile one vLLM instance, plan replicas on "
                                     "one device, and validate the plan.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _PARSERS:
        add(sub)
    return parser


_PARSERS: list[Callable[[argparse._SubParsersAction], None]] = [_plan_parser]  # type: ignore[type-arg]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code: int = args.run(args)
    except (PlannerError, PlanError) as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
