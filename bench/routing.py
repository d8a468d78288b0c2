"""Routing policies compared on simulated replicas of one GPU, in virtual time, through the gateway's own code.

Setup: four OPT-1.3B replicas on one H100 64 GB (the calibrated card), each with max_num_seqs 64 and 0.225 of
the memory. Workloads: `mixed` (90% short requests, 10% long ones) and `sharegpt` (lognormal lengths). Arrivals:
Poisson, and bursty gamma (CV 3), at 50%, 80% and 95% of the node's capacity for that mix. Policies: the
gateway's five. Admission queue off: replicas uncapped, every request goes to a replica at once and waits in
vLLM's own queue there (early binding). On: each replica capped at 64 in-flight requests (its batch cap) and the
gateway's FIFO queue (`Router.acquire`) holds the rest until a replica frees a slot (late binding).

    python -m bench.routing [--requests 2000] [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from gateway.config import POLICY_NAMES, QueueConfig
from sim.fleet import capacity, run_routed, saturation_sample
from sim.gpus import get_gpu
from sim.model import load_model
from sim.node import NodeSpec
from sim.workload import RequestSpec, gamma_arrivals, mixed, poisson_arrivals, sharegpt_like

from .common import figure_path, markdown_table, pyplot, save

REPLICAS, BATCH, UTIL = 4, 64, 0.225
LOADS = (0.5, 0.8, 0.95)
WORKLOADS: dict[str, Callable[[int, np.random.Generator], list[RequestSpec]]] = {
    "mixed": mixed, "sharegpt": sharegpt_like}
ARRIVALS: dict[str, Callable[[int, float, np.random.Generator], np.ndarray]] = {
    "poisson": poisson_arrivals,
    "gamma_cv3": lambda n, rate, rng: gamma_arrivals(n, rate, 3.0, rng),
}
QUEUE = QueueConfig(max_size=1_000_000, max_wait_s=3600)


def spec() -> NodeSpec:
    return NodeSpec(load_model("opt-1.3b"), get_gpu("H100-64GB"), REPLICAS, BATCH, UTIL)


def run(n: int, loads: tuple[float, ...], seed: int = 0) -> list[dict[str, Any]]:
    node = spec()
    rows = []
    for wname, make in WORKLOADS.items():
        specs = make(n, np.random.default_rng(seed))
        cap = capacity(node, saturation_sample(node, specs))
        print(f"{wname}: capacity {cap:.1f} req/s")
        for aname, arrivals_of in ARRIVALS.items():
            for load in loads:
                arrivals = arrivals_of(n, load * cap, np.random.default_rng(seed + 1))
                for policy in POLICY_NAMES:
                    for queued in (False, True):
                        s = run_routed(node, specs, arrivals, policy, seed, BATCH if queued else None,
                                       QUEUE if queued else None)
                        rows.append({"workload": wname, "arrivals": aname, "load": load, "capacity_req_s": cap,
                                     "policy": policy, "queue": queued, **asdict(s)})
                print(f"  {aname} at {load:.0%}: done")
    return rows


def table(rows: list[dict[str, Any]], loads: tuple[float, ...]) -> str:
    header = ["workload", "arrivals", "load", "policy", "queue", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 s",
              "e2e p99 s", "tok/s", "imbalance"]
    body = [[r["workload"], r["arrivals"], f"{r['load']:.0%}", r["policy"], "on" if r["queue"] else "off",
             f"{r['ttft_p50'] * 1e3:.0f}", f"{r['ttft_p99'] * 1e3:.0f}", f"{r['e2e_p50']:.2f}",
             f"{r['e2e_p99']:.2f}", f"{r['tokens_s']:,.0f}", f"{r['imbalance']:.2f}"]
            for r in rows if r["load"] in loads]
    return markdown_table(header, body)


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    for metric, label, scale, name in (("ttft_p99", "TTFT p99 (s)", 1.0, "routing_ttft_p99.png"),
                                       ("e2e_p99", "end-to-end p99 (s)", 1.0, "routing_e2e_p99.png"),
                                       ("imbalance", "load imbalance (max/mean outstanding tokens)", 1.0,
                                        "routing_imbalance.png")):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for ax, (wname, aname) in zip(axes.flat, [(w, a) for w in WORKLOADS for a in ARRIVALS]):
            for i, policy in enumerate(POLICY_NAMES):
                for queued, style in ((False, "-"), (True, "--")):
                    pts = sorted((r["load"], r[metric] * scale) for r in rows if r["workload"] == wname
                                 and r["arrivals"] == aname and r["policy"] == policy and r["queue"] == queued)
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", color=f"C{i}",
                                label=f"{policy}{' + queue' if queued else ''}")
            ax.set_title(f"{wname}, {aname}")
            ax.set_xlabel("offered load (fraction of capacity)")
            ax.set_ylabel(label)
            if metric != "imbalance":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"Routing: {REPLICAS} x OPT-1.3B (batch {BATCH}) on one simulated H100 64 GB; "
                     "solid: no admission queue, dashed: queue")
        fig.tight_layout()
        fig.savefig(figure_path(name), dpi=90)
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per run (2000)")
    parser.add_argument("--quick", action="store_true", help="only 95%% load, 600 requests (a smoke run)")
    args = parser.parse_args(argv)
    loads = (0.95,) if args.quick else LOADS
    n = 600 if args.quick else args.requests
    started, cpu = time.perf_counter(), time.process_time()
    rows = run(n, loads)
    text = table(rows, loads)
    save("routing", {"setup": {"replicas": REPLICAS, "max_num_seqs": BATCH, "utilization": UTIL,
                               "model": "opt-1.3b", "gpu": "H100-64GB", "requests_per_run": n}, "rows": rows}, text)
    plot(rows)
    print(text)
    print(f"{len(rows)} runs in {time.perf_counter() - started:.0f} s wall, {time.process_time() - cpu:.0f} s CPU")


if __name__ == "__main__":
    main()
