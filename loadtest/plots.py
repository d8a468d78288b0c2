"""PNG plots of a run (or of several, overlaid): latency CDFs, the run over time, requests per replica."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from loadtest.records import RequestRecord  # noqa: E402
from loadtest.report import metric_values, timeline  # noqa: E402

TITLES = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
          "e2el": "End-to-end latency"}
DPI = 110


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    """CDFs of TTFT, TPOT, ITL and E2E latency, one line per run, p50 and p99 marked."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), layout="constrained")
    for ax, metric in zip(axes.flat, TITLES):
        for name, records in runs.items():
            ms = np.sort(metric_values(records, metric)) * 1000.0
            if ms.size == 0:
                continue
            line, = ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=name if len(runs) > 1 else None)
            for p, style in ((50, ":"), (99, "--")):
                value = float(np.percentile(ms, p))
                ax.axvline(value, color=line.get_color(), linestyle=style, linewidth=0.8)
                if len(runs) == 1:
                    ax.annotate(f"p{p} {value:.1f}", (value, p / 100), xytext=(4, -12), textcoords="offset points",
                                fontsize=8)
        ax.set_title(TITLES[metric])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of token gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(runs) > 1 and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Latency CDFs (dotted p50, dashed p99)")
    return _save(fig, path)


def over_time(records: Sequence[RequestRecord], path: Path, schedule: Sequence[float] | None = None,
              bursts: Sequence[float] = (), bin_s: float = 1.0) -> Path:
    """Send rate against the schedule, throughput, requests in flight and TTFT, over the run."""
    tl = timeline(records, schedule, bin_s)
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True, layout="constrained")
    if schedule is not None:
        axes[0].stairs(tl.scheduled, tl.edges, label="scheduled", color="0.75", linewidth=4)
    axes[0].stairs(tl.sent, tl.edges, label="sent", color="tab:blue", linewidth=1.5)
    axes[0].stairs(tl.completed, tl.edges, label="completed", color="tab:orange", linewidth=1.2, linestyle="--")
    axes[0].set_ylabel(f"requests/s ({bin_s:g} s bins)")
    axes[0].set_title("Requests: scheduled, actually sent, completed")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[1].stairs(tl.output_tokens, tl.edges, color="tab:green")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("Output token throughput")
    axes[2].step(tl.in_flight_t, tl.in_flight_n, where="post", color="tab:purple")
    axes[2].set_ylabel("requests in flight")
    axes[2].set_title("Concurrency")
    ok = [(r.sent_s, r.ttft_s, r.e2e_s) for r in records if r.ok and r.ttft_s is not None]
    failed = [r for r in records if not r.ok]
    sent, ttft, e2e = (np.array(column) for column in zip(*ok)) if ok else (np.empty(0),) * 3
    axes[3].scatter(sent, ttft * 1000, s=6, label="TTFT", color="tab:blue")
    axes[3].scatter(sent, e2e * 1000, s=6, label="E2E", color="tab:orange", alpha=0.5)
    if failed:
        axes[3].scatter([r.sent_s for r in failed], [r.e2e_s * 1000 for r in failed], s=12, marker="x",
                        label="failed", color="tab:red")
    axes[3].set_ylabel("ms")
    axes[3].set_xlabel("seconds since the start (by send time in the bottom panel)")
    axes[3].set_title("Latency of each request by its send time")
    axes[3].legend(fontsize=8, loc="upper right")
    for ax in axes:
        ax.grid(alpha=0.3)
        for at in bursts:
            ax.axvline(at, color="tab:red", linewidth=0.8, alpha=0.6)
    if len(bursts):
        fig.suptitle("Red lines: bursts")
    return _save(fig, path)


def per_replica(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    """Requests per replica (the gateway's x-gateway-replica header, else the host sent to)."""
    ok: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    labels: dict[str, None] = {}  # runs in their order, replicas sorted within each
    for name, records in runs.items():
        for r in sorted(records, key=lambda r: r.replica or r.target):
            label = f"{name}: {r.replica or r.target}" if len(runs) > 1 else (r.replica or r.target)
            labels.setdefault(label)
            (ok if r.ok else bad)[label] += 1
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.45 * max(len(labels), 1)), layout="constrained")
    y = np.arange(len(labels))
    ax.barh(y, [ok[label] for label in labels], height=0.6, color="tab:blue", label="completed")
    ax.barh(y, [bad[label] for label in labels], height=0.6, left=[ok[label] for label in labels],
            color="tab:red", label="failed")
    for i, label in enumerate(labels):
        ax.annotate(str(ok[label] + bad[label]), (ok[label] + bad[label], i), xytext=(3, -3),
                    textcoords="offset points", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, 1.1 * max([ok[label] + bad[label] for label in labels], default=1))
    ax.set_xlabel("requests")
    ax.set_title("Requests per replica (gateway's x-gateway-replica header, else the host sent to)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def write_run_plots(records: Sequence[RequestRecord], out: Path, schedule: Sequence[float] | None,
                    bursts: Sequence[float]) -> list[Path]:
    """The three PNGs of one run, in `out`."""
    span = max((r.end_s for r in records), default=1.0)
    bin_s = max(1.0, round(span / 120))  # about a hundred bins whatever the length
    return [
        latency_cdfs({"run": records}, out / "latency_cdf.png"),
        over_time(records, out / "over_time.png", schedule, bursts, bin_s),
        per_replica({"run": records}, out / "replicas.png"),
    ]
