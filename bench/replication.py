"""Replication against the single-instance frontier, simulated: the papers' Figures 1 and 5 by our own tools.

For OPT-125M, OPT-1.3B and OPT-2.7B on an A100 40 GB and an H100 64 GB (the calibrated card):

- the single-instance frontier: one vLLM instance (memory fraction 0.9) swept over the batch cap B, all 2000
  ShareGPT-like requests sent at once (as the reference), total tokens/s against mean time per output token;
- replication: N = 2 and 4 instances on the same GPU, each with 0.9/N of the memory, swept over the same batch
  caps (per instance), the requests split round-robin: one frontier per N;
- the batch that fits: the largest power-of-two B that runs the 2404.03353 workload (512 prompt + 256 output
  tokens, 500 requests) on the A100 40 GB without a preemption, beside that paper's figure.

    python -m bench.replication
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from sim.calibrate import REFERENCE_REQUESTS, RunResult, requests_for, run_all_at_once
from sim.gpus import get_gpu
from sim.model import load_model
from sim.steptime import StepCost
from sim.workload import RequestSpec, sharegpt_like

from .common import figure_path, markdown_table, pyplot, save

MODELS = ("opt-125m", "opt-1.3b", "opt-2.7b")
GPUS = ("A100-40GB", "H100-64GB")
BATCHES = (1, 4, 16, 32, 64, 128, 256, 512)
REPLICAS = (1, 2, 4)
PAPER_FITS = {"opt-125m": 512, "opt-1.3b": 256, "opt-2.7b": 128}  # arXiv 2404.03353, A100 40 GB, vLLM 0.1.7


def _row(model: str, gpu: str, r: RunResult) -> dict[str, Any]:
    return {"model": model, "gpu": gpu, "max_num_seqs": r.max_num_seqs, "replicas": r.replicas,
            "total_tok_s": r.total_tok_s, "output_tok_s": r.output_tok_s, "mean_tpot_ms": r.mean_tpot_ms,
            "mean_ttft_ms": r.mean_ttft_ms, "preemptions": r.preemptions, "kv_blocks_each": r.kv_blocks_each,
            "requests": r.requests}


def _run(model: str, gpu: str, batch: int, replicas: int, specs: list[RequestSpec]) -> RunResult | None:
    try:
        return run_all_at_once(load_model(model), get_gpu(gpu), StepCost(), batch, replicas, specs)
    except ValueError as exc:  # the model does not fit in 0.9/N of the GPU
        print(f"  {model} x{replicas} on {gpu}: {exc}")
        return None


def sweep(specs: list[RequestSpec]) -> list[dict[str, Any]]:
    """Every (GPU, model, replicas, batch cap); fewer requests where the total batch is small (steady state)."""
    rows: list[dict[str, Any]] = []
    for gpu in GPUS:
        for model in MODELS:
            for n in REPLICAS:
                for b in BATCHES:
                    r = _run(model, gpu, b, n, specs[:requests_for(b * n)])
                    if r:
                        rows.append(_row(model, gpu, r))
            print(f"{model} on {gpu}: done")
    return rows


def largest_fitting_batch(model: str) -> int:
    specs = [RequestSpec(512, 256)] * 500
    fits = 0
    for b in (16, 32, 64, 128, 256, 512):
        r = _run(model, "A100-40GB", b, 1, specs)
        if r is None or r.preemptions:
            break
        fits = b
    return fits


def tables(rows: list[dict[str, Any]], fits: dict[str, int]) -> str:
    body = [[r["gpu"], r["model"], r["replicas"], r["max_num_seqs"], f"{r['total_tok_s']:,.0f}",
             f"{r['mean_tpot_ms']:.1f}", r["preemptions"], f"{r['kv_blocks_each']:,}"] for r in rows]
    out = [markdown_table(["GPU", "model", "replicas", "max_num_seqs each", "total tok/s", "mean TPOT ms",
                           "preemptions", "KV blocks each"], body), ""]
    body = [[m, fits[m], PAPER_FITS[m]] for m in MODELS]
    out += ["**Largest power-of-two batch without preemption, A100 40 GB, 512+256 tokens**", "",
            markdown_table(["model", "simulated", "arXiv 2404.03353"], body)]
    return "\n".join(out)


def best(rows: list[dict[str, Any]], gpu: str, model: str, n: int) -> dict[str, Any] | None:
    mine = [r for r in rows if r["gpu"] == gpu and r["model"] == model and r["replicas"] == n]
    return max(mine, key=lambda r: r["total_tok_s"]) if mine else None


def gains(rows: list[dict[str, Any]]) -> str:
    header = ["GPU", "model"] + [f"best with {n} (B each)" for n in REPLICAS] + [f"x{n} over x1" for n in REPLICAS[1:]]
    body = []
    for gpu in GPUS:
        for model in MODELS:
            bests = [best(rows, gpu, model, n) for n in REPLICAS]
            one = bests[0]
            cells = [f"{b['total_tok_s']:,.0f} ({b['max_num_seqs']})" if b else "does not fit" for b in bests]
            ratios = [f"{b['total_tok_s'] / one['total_tok_s'] - 1:+.0%}" if b and one else "-" for b in bests[1:]]
            body.append([gpu, model, *cells, *ratios])
    return markdown_table(header, body)


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    styles = {1: "-o", 2: "--s", 4: ":^"}
    for ax, gpu in zip(axes, GPUS):
        for i, model in enumerate(MODELS):
            for n in REPLICAS:
                pts = sorted((r["mean_tpot_ms"], r["total_tok_s"], r["max_num_seqs"]) for r in rows
                             if r["gpu"] == gpu and r["model"] == model and r["replicas"] == n)
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[n], color=f"C{i}", ms=4,
                        label=f"{model}, {n} instance{'s' if n > 1 else ''}")
                if n == 1:
                    for x, y, b in pts:
                        ax.annotate(str(b), (x, y), fontsize=6, xytext=(2, -9), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plt.matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
        ax.set_xlabel("mean time per output token (ms)")
        ax.set_ylabel("total tokens/s")
        ax.set_title(f"{gpu}: frontiers over the batch cap (labels: B of one instance)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figure_path("replication_frontier.png"), dpi=90)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, gpu in zip(axes, GPUS):
        for i, model in enumerate(MODELS):
            pts = [(n, b["total_tok_s"], b["max_num_seqs"]) for n in REPLICAS
                   if (b := best(rows, gpu, model, n))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=f"C{i}", label=model)
                for n, y, b in pts:
                    ax.annotate(f"B={b}", (n, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("instances on the GPU")
        ax.set_ylabel("best total tokens/s over B")
        ax.set_title(f"{gpu}: tokens/s against replica count")
        ax.set_xticks(REPLICAS)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(figure_path("replication_replicas.png"), dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    started, cpu = time.perf_counter(), time.process_time()
    specs = sharegpt_like(REFERENCE_REQUESTS, np.random.default_rng(0))
    rows = sweep(specs)
    fits = {m: largest_fitting_batch(m) for m in MODELS}
    text = gains(rows) + "\n\n" + tables(rows, fits)
    save("replication", {"rows": rows, "largest_fitting_batch_a100": fits}, text)
    plot(rows)
    print(text)
    print(f"{len(rows)} runs in {time.perf_counter() - started:.0f} s wall, {time.process_time() - cpu:.0f} s CPU")


if __name__ == "__main__":
    main()
