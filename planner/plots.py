"""PNG pictures of a profile and a validation (matplotlib's object API and Agg: no pyplot, no display).

- `frontier.png` (the papers' Figure 1): throughput against latency, one point per B, B* and the BCA pick
  marked; beside it throughput against B with the monotone envelope and the epsilon band.
- `replicas.png` (their Figure 5): total throughput and latency against the replica count, the kept count marked.
- `gpu.png`: GPU utilization, memory and power against B, only when the profile measured them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from planner.choice import BcaChoice, Choice, ChoiceConfig, bca_choice, choose_batch
from planner.errors import PlannerError
from planner.points import Profile, ProfilePoint
from planner.validate import CountResult

_LATENCIES = (("tpot_ms.mean", "mean TPOT (ms)"), ("itl_ms.mean", "mean ITL (ms)"), ("e2e_ms.mean", "mean e2e (ms)"))
BLUE, ORANGE, GREEN, GREY, RED = "#0072B2", "#E69F00", "#009E73", "#999999", "#D55E00"


def _latency_axis(points: Sequence[ProfilePoint]) -> tuple[str, str]:
    for metric, label in _LATENCIES:
        if all(p.latency(metric) is not None for p in points):
            return metric, label
    raise PlannerError("the profile has no latency measured at every B (mean TPOT, ITL or e2e): nothing to plot")


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _frontier_panel(ax: Axes, points: Sequence[ProfilePoint], choice: Choice, bca: BcaChoice | None) -> None:
    metric, label = _latency_axis(points)
    xs = [p.latency(metric) or 0.0 for p in points]
    ys = [p.total_tok_s for p in points]
    ax.plot(xs, ys, "-o", color=BLUE, zorder=2, label="measured, one point per B")
    for p, x, y in zip(points, xs, ys):
        ax.annotate(f"B={p.batch_size}", (x, y), textcoords="offset points", xytext=(6, -12), fontsize=8,
                    color=RED if p.preemptions else "black")
    preempted = [i for i, p in enumerate(points) if p.preemptions]
    if preempted:
        ax.scatter([xs[i] for i in preempted], [ys[i] for i in preempted], marker="x", s=90, color=RED, zorder=3,
                   label="preemptions (excluded)")
    star = next(i for i, p in enumerate(points) if p.batch_size == choice.batch_size)
    ax.scatter([xs[star]], [ys[star]], marker="*", s=320, color=ORANGE, edgecolor="black", zorder=4,
               label=f"B* = {choice.batch_size} (within {choice.epsilon:.0%} of the plateau)")
    if bca is not None and bca.batch_size is not None and bca.batch_size != choice.batch_size:
        i = next(i for i, p in enumerate(points) if p.batch_size == bca.batch_size)
        ax.scatter([xs[i]], [ys[i]], marker="D", s=80, color=GREEN, edgecolor="black", zorder=4,
                   label=f"BCA rule: B = {bca.batch_size}")
    ax.set_xlabel(label)
    ax.set_ylabel("total tokens/s")
    ax.set_title("Throughput against latency")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, linestyle="--", linewidth=0.5)
    ax.legend(loc="lower right", fontsize=8)


def _envelope_panel(ax: Axes, points: Sequence[ProfilePoint], choice: Choice) -> None:
    sizes = [p.batch_size for p in points]
    ax.plot(sizes, [p.total_tok_s for p in points], "o", color=BLUE, label="measured")
    fitted = [(c.batch_size, c.envelope_tok_s) for c in choice.candidates if c.envelope_tok_s is not None]
    ax.plot(*zip(*fitted), "-", color=GREY, linewidth=2, label="monotone envelope")
    ax.axhspan(choice.threshold_tok_s, choice.best_tok_s, color=ORANGE, alpha=0.2,
               label=f"within {choice.epsilon:.0%} of the best ({choice.best_tok_s:.0f})")
    ax.axvline(choice.batch_size, color=ORANGE, linestyle="--", label=f"B* = {choice.batch_size}")
    if min(sizes) > 0 and max(sizes) / min(sizes) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes], fontsize=7, rotation=60)
    ax.minorticks_off()
    ax.set_xlabel("batch cap B (--max-num-seqs)")
    ax.set_ylabel("total tokens/s")
    ax.set_title("Throughput against B")
    ax.set_ylim(bottom=0)
    ax.grid(True, linestyle="--", linewidth=0.5)
    ax.legend(loc="lower right", fontsize=8)


def plot_frontier(profile: Profile, path: Path, choice: Choice | None = None, bca: BcaChoice | None = None,
                  title: str | None = None) -> Path:
    """Figure 1: throughput against latency per B, with B* (and the BCA pick) marked; throughput against B."""
    choice = choice or choose_batch(profile.points, ChoiceConfig())
    fig = Figure(figsize=(13, 5))
    left, right = fig.subplots(1, 2)
    _frontier_panel(left, profile.points, choice, bca)
    _envelope_panel(right, profile.points, choice)
    fig.suptitle(title or f"{profile.context.model or Path(profile.context.source).name}: single-instance frontier")
    return _save(fig, path)


def plot_replicas(results: Sequence[CountResult], best: int, path: Path) -> Path:
    """Figure 5: total throughput (bars) and latency (lines) against the number of replicas."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    counts = [r.replicas for r in results]
    bars = ax.bar([str(c) for c in counts], [r.summary.total_tok_s for r in results],
                  color=[ORANGE if c == best else BLUE for c in counts], edgecolor="black")
    base = results[0].summary.total_tok_s
    for bar, r in zip(bars, results):
        gain = f"{r.summary.total_tok_s / base - 1:+.0%}" if base and r is not results[0] else ""
        ax.annotate(f"{r.summary.total_tok_s:.0f} {gain}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xlabel(f"replicas (kept: {best}, orange)")
    ax.set_ylabel("total tokens/s (bars)")
    ax.set_ylim(0, max(r.summary.total_tok_s for r in results) * 1.2)
    lat = ax.twinx()
    for attr, label, style in (("tpot_ms", "p99 TPOT", "-o"), ("ttft_ms", "p99 TTFT", "--s")):
        values = [getattr(r.summary, attr).p99 for r in results]
        if all(v is not None for v in values):
            lat.plot([str(c) for c in counts], values, style, color=RED if attr == "tpot_ms" else GREEN, label=label)
    lat.set_ylabel("latency (ms, lines)")
    lat.set_ylim(bottom=0)
    lat.legend(loc="upper left", fontsize=8)
    ax.set_title("Replicas on one device: throughput and latency")
    return _save(fig, path)


def plot_gpu(profile: Profile, path: Path) -> Path | None:
    """GPU utilization (mean, max), memory used and power against B; None when nothing was measured."""
    measured = [(str(p.batch_size), p.gpu) for p in profile.points if p.gpu is not None]
    if not measured:
        return None
    sizes = [b for b, _ in measured]
    gpus = [g for _, g in measured]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ax.plot(sizes, [g.utilization_mean_pct or 0.0 for g in gpus], "-o", color=BLUE, label="mean utilization %")
    ax.plot(sizes, [g.utilization_max_pct or 0.0 for g in gpus], ":o", color=BLUE, label="max utilization %")
    ax.set_ylim(0, 105)
    ax.set_xlabel("batch cap B")
    ax.set_ylabel("GPU utilization (%)")
    other = ax.twinx()
    other.plot(sizes, [(g.memory_used_max_bytes or 0) / 2**30 for g in gpus], "-s", color=ORANGE,
               label="memory used, max (GiB)")
    power = [g.power_mean_w for g in gpus]
    if all(w is not None for w in power):
        other.plot(sizes, [w or 0.0 for w in power], "--^", color=GREEN, label="mean power (W)")
    other.set_ylabel("GiB / W")
    other.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = other.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, loc="lower right", fontsize=8)
    ax.set_title(f"GPU while profiling ({gpus[0].name})")
    return _save(fig, path)


def plot_profile(profile: Profile, directory: Path, choice: Choice | None = None,
                 bca: BcaChoice | None = None) -> list[Path]:
    """Every picture the profile supports, in `directory`."""
    choice = choice or choose_batch(profile.points, ChoiceConfig())
    bca = bca or bca_choice(profile.points)
    written = [plot_frontier(profile, directory / "frontier.png", choice, bca)]
    gpu = plot_gpu(profile, directory / "gpu.png")
    return written + ([gpu] if gpu else [])
