"""Several models on one GPU, simulated: the planner's packing against the obvious alternatives, and goodput
against the memory split.

    python -m bench.multimodel [--models FILE] [--out DIR] [--duration 60] [--quick]

For a models file with synthetic profiles (default: the four-model H100 example of docs/multimodel.md), it plans
the packing (`planner plan --models`), then runs the same mixed Poisson traffic in the simulator (sim/multimodel.py:
every replica on one simulated GPU) for three arrangements: the packed plan, an equal memory split (each model's
best replicas and batch cap within its 1/N share), and one replica each at the default share (B=128). Goodput is
the requests per second that met their model's p99 TTFT goal. Then, for the file's first two models alone, it
sweeps the first model's share of the memory and draws goodput against it (`multimodel-split.png`), with the
planner's split marked. Writes `multimodel.json` and the figures into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from planner.multimodel import MultiSpec, load_spec, spec_from_dict
from planner.multiplan import DEFAULT_BATCH, demands, device_bytes, make_multi_plan
from planner.packing import Demand, Option, common_headroom, options
from sim.gpus import get_gpu
from sim.model import load_model
from sim.multimodel import ModelLoad, ModelResult, simulate

EXAMPLE: dict[str, Any] = {
    "gpu": "H100", "slo": {"p99_ttft_ms": 500},
    "models": [
        {"name": "chat", "profile": "synthetic:qwen3-1.7b", "traffic": {"rate": 8, "input_tokens": 1024,
                                                                       "output_tokens": 256}},
        {"name": "code", "profile": "synthetic:llama-3.2-1b", "slo": {"p99_ttft_ms": 300},
         "traffic": {"rate": 10, "input_tokens": 2048, "output_tokens": 128}},
        {"name": "small", "profile": "synthetic:smollm2-135m", "traffic": {"rate": 100, "input_tokens": 256,
                                                                         "output_tokens": 64}},
        {"name": "embed", "kind": "embed", "profile": "synthetic:qwen3-0.6b", "slo": {"p99_ttft_ms": 100},
         "traffic": {"rate": 300, "input_tokens": 512}}]}

Layout = dict[str, tuple[int, int, float]]  # model -> (replicas, max_num_seqs, utilization per replica)


def packed_layout(spec: MultiSpec) -> Layout:
    plan = make_multi_plan(spec).plan
    return {m.name: (len(plan.replicas_of(m.name)), plan.replicas_of(m.name)[0].max_num_seqs or 1,
                     plan.replicas_of(m.name)[0].gpu_memory_utilization or 0.0) for m in plan.models}


def best_within(demand: Demand, share_bytes: float, rates: dict[str, float]) -> Option | None:
    fitting = [o for o in options(demand) if o.memory_bytes <= share_bytes]
    return max(fitting, key=lambda o: common_headroom([o], rates)) if fitting else None


def split_layout(spec: MultiSpec, shares: Sequence[float]) -> Layout:
    """Each model its share of the usable memory, and within it its best option (replicas, B)."""
    total = device_bytes(spec)
    wanted = demands(spec)
    rates = {d.name: d.rate for d in wanted}
    layout: Layout = {}
    for demand, share in zip(wanted, shares):
        option = best_within(demand, share * spec.usable_fraction * total, rates)
        if option is not None:
            layout[demand.name] = (option.replicas, option.batch_size, share * spec.usable_fraction / option.replicas)
    return layout


def default_layout(spec: MultiSpec) -> Layout:
    """deploy's default without a plan: one replica each, B=128, usable / models of the memory."""
    share = spec.usable_fraction / len(spec.models)
    return {m.name: (1, DEFAULT_BATCH["gpu"], share) for m in spec.models}


def run_layout(spec: MultiSpec, layout: Layout, scale: float, duration_s: float, seed: int) -> dict[str, Any]:
    gpu = get_gpu(spec.gpu)
    loads, missing = [], []
    for m in spec.models:
        if m.name not in layout:
            missing.append(m.name)
            continue
        replicas, batch, utilization = layout[m.name]
        loads.append(ModelLoad(m.name, load_model(m.profile), replicas, batch, utilization, m.traffic.rate * scale,
                               m.traffic.input_tokens, m.traffic.output_tokens,
                               (m.goal.p99_ttft_ms or 1e9) / 1000))
    try:
        results = simulate(loads, gpu, duration_s, seed)
    except ValueError as exc:  # a replica whose share holds no KV cache: vLLM would refuse to start
        return {"error": str(exc), "goodput_rps": 0.0, "within_goal": 0.0, "models": {}}
    # a model left out (no share holds it) misses every request it would have had
    results += [ModelResult(name, round(m.traffic.rate * scale * duration_s), float("inf"), 0.0, 0.0)
                for m in spec.models for name in missing if m.name == name]
    good = sum(r.goodput_rps for r in results)
    sent = sum(r.requests for r in results)
    return {"goodput_rps": round(good, 2), "within_goal": round(good * duration_s / sent, 4) if sent else 1.0,
            "worst_model_within_goal": round(min(r.within_goal for r in results), 4),
            "models": {r.name: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(r).items()}
                       for r in results}, "layout": {k: list(v) for k, v in layout.items()}}


def compare(spec: MultiSpec, scales: Sequence[float], duration_s: float, seed: int) -> dict[str, Any]:
    n = len(spec.models)
    layouts = {"packed": packed_layout(spec), "equal_split": split_layout(spec, [1 / n] * n),
               "one_replica_each": default_layout(spec)}
    return {name: {str(scale): run_layout(spec, layout, scale, duration_s, seed) for scale in scales}
            for name, layout in layouts.items()}


def split_sweep(spec: MultiSpec, shares: Sequence[float], scales: Sequence[float], duration_s: float,
                seed: int) -> dict[str, Any]:
    """The first two models alone: goodput as the first model's share of the memory goes from low to high."""
    two = replace(spec, models=spec.models[:2])
    planned = packed_layout(two)
    first = spec.models[0].name
    planned_share = planned[first][0] * planned[first][2] / two.usable_fraction
    rows = []
    for share in shares:
        layout = split_layout(two, [share, 1 - share])
        rows.append({"share": share, **{str(s): run_layout(two, layout, s, duration_s, seed) for s in scales}})
    return {"models": [m.name for m in two.models], "planned_share": round(planned_share, 4),
            "planned": {str(s): run_layout(two, planned, s, duration_s, seed) for s in scales}, "sweep": rows}


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    sweep = result["split"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for scale in sweep["planned"]:
        xs = [row["share"] for row in sweep["sweep"]]
        ys = [row[scale]["within_goal"] for row in sweep["sweep"]]
        line, = ax.plot(xs, ys, marker="o", label=f"{scale} x traffic: fixed splits")
        ax.plot([sweep["planned_share"]], [sweep["planned"][scale]["within_goal"]], marker="*", markersize=16,
                color=line.get_color(), linestyle="none", label=f"{scale} x traffic: the planner's packing")
    first, second = sweep["models"]
    ax.set_xlabel(f"share of the usable GPU memory given to {first} (the rest to {second})")
    ax.set_ylabel("goodput: share of requests within their TTFT goal")
    ax.set_ylim(0, 1.05)
    ax.set_title("Two models on one simulated H100: goodput against the memory split")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower center")
    fig.tight_layout()
    paths.append(out / "multimodel-split.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, by_scale in result["compare"].items():
        scales = list(by_scale)
        ax.plot([float(s) for s in scales], [by_scale[s]["within_goal"] for s in scales], marker="o", label=name)
    ax.set_xlabel("traffic, x the stated rate of every model")
    ax.set_ylabel("goodput: share of requests within their TTFT goal")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{len(result['models'])} models on one simulated {result['gpu']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "multimodel-compare.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multimodel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, help="a models file with synthetic profiles (default: the example)")
    parser.add_argument("--out", type=Path, default=Path("multimodel-bench"))
    parser.add_argument("--duration", type=float, default=30.0, help="simulated seconds of traffic per run (30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short runs, few points (CI)")
    args = parser.parse_args(argv)
    spec = load_spec(args.models) if args.models else spec_from_dict(EXAMPLE)
    if spec.device != "gpu" or any(not m.profile.startswith("synthetic:") for m in spec.models):
        print("bench.multimodel: the simulator needs a GPU models file with synthetic:NAME profiles", file=sys.stderr)
        return 2
    duration = 10.0 if args.quick else args.duration
    scales = (1.0, 2.0) if args.quick else (1.0, 1.5, 2.0, 2.5, 3.0)
    shares = (0.3, 0.5, 0.7) if args.quick else tuple(round(0.1 * k, 1) for k in range(1, 10))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": spec.gpu, "models": [m.name for m in spec.models], "duration_s": duration, "seed": args.seed,
              "compare": compare(spec, scales, duration, args.seed),
              "split": split_sweep(spec, shares, (2.0,) if args.quick else (2.0, 3.0), duration, args.seed)}
    (args.out / "multimodel.json").write_text(json.dumps(result, indent=1))
    for name, by_scale in result["compare"].items():
        row = ", ".join(f"{s} x: {r['within_goal']:.1%}" for s, r in by_scale.items())
        print(f"{name:>17}: within goal {row}")
    sweep = result["split"]
    print(f"split of {' / '.join(sweep['models'])}: " + ", ".join(
        f"{row['share']:.1f}: {row['2.0']['within_goal']:.1%}" for row in sweep["sweep"]) +
        f" (2 x traffic); planned {sweep['planned_share']:.2f}: {sweep['planned']['2.0']['within_goal']:.1%}")
    for path in plot(result, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
