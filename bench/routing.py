"""Routing policies compared on simulated replicas of one GPU, in virtual time, through the gateway's own code.

Setup: four OPT-1.3B replicas on one H100 64 GB (the calibrated card), each with max_num_seqs 64 and 0.225 of
the memory; the gateway knows each replica's batch cap and speed (what a profile of one replica measures), as
`deploy` tells it from a plan. Policies: the gateway's seven, `prefix_affinity` the default.

Single-turn (`mixed`: 90% short requests, 10% long; `sharegpt`: lognormal lengths). Arrivals: Poisson, and bursty
gamma (CV 3), at 50%, 80% and 95% of the node's capacity for that mix. Each request carries the affinity key the
gateway derives for a completions prompt: its own, and a prompt longer than the keyed head (1,024 bytes) counts
that head as possibly cached, so `prefix_affinity`'s affinity term is active on the long prompts.

Multi-turn chat (`chat`: a 256-token system prompt shared by all, 2-8 turns, lognormal messages and replies, 5 s
of think time on average; `--sharegpt FILE` adds chats built from a ShareGPT file): conversations start as a
Poisson process sized to 50%, 80% and 95% of the node's capacity for the turns' sizes without caching, each turn
sent when the previous reply ended plus the think time, with the engines' prefix caches on. `oracle` pins each
conversation to the replica its first turn went to (chosen by `estimated_ttft`), whatever the load.

Admission queue off: replicas uncapped, every request goes to a replica at once and waits in vLLM's own queue
there. On: each replica capped at 64 in-flight requests (its batch cap) in the gateway, whose FIFO queue
(`Router.acquire`) holds the rest. Percentiles pool every request of `--seeds` seeds (default 3).

LoRA adapters (`--lora`): the same node, the `mixed` workload under Poisson arrivals, each request naming one of
16 adapters by Zipf popularity (s = 1), each replica holding 4 at once and a load taking 0.2 s (sim/lora.py):
adapter-aware routing (the gateway's `AdapterRouter.choose`) against adapter-blind (the policy alone), both over
the default policy.

    python -m bench.routing [--requests 2000] [--conversations 2000] [--seeds 3] [--jobs 1] [--quick]
    python -m bench.routing --lora [--requests 2000] [--seeds 3] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import DEFAULT_POLICY, POLICY_NAMES, QueueConfig
from gateway.policies import make_policy
from sim.fleet import Pinned, Record, Summary, capacity, run_conversations, run_routed, saturation_sample
from sim.gpus import get_gpu
from sim.model import load_model
from sim.node import NodeSpec
from sim.workload import (Conversation, RequestSpec, conversations, gamma_arrivals, mixed, poisson_arrivals,
                          sharegpt_conversations, sharegpt_like)

from .common import RESULTS, figure_path, markdown_table, pyplot, save

REPLICAS, BATCH, UTIL = 4, 64, 0.225
LOADS = (0.5, 0.8, 0.95)
WORKLOADS: dict[str, Callable[[int, np.random.Generator], list[RequestSpec]]] = {
    "mixed": mixed, "sharegpt": sharegpt_like}
ARRIVALS: dict[str, Callable[[int, float, np.random.Generator], np.ndarray]] = {
    "poisson": poisson_arrivals,
    "gamma_cv3": lambda n, rate, rng: gamma_arrivals(n, rate, 3.0, rng),
}
QUEUE = QueueConfig(max_size=1_000_000, max_wait_s=3600)
ORACLE = "oracle"
LOAD_ONLY = tuple(p for p in POLICY_NAMES if p not in ("prefix_affinity", "consistent_hash"))
BOUND = 1.10  # the default's p99 TTFT may be at most this times the best other policy's


def spec() -> NodeSpec:
    return NodeSpec(load_model("opt-1.3b"), get_gpu("H100-64GB"), REPLICAS, BATCH, UTIL)


@dataclass(frozen=True)
class Task:
    """One simulated run: a point of the sweep, a policy, a seed."""

    section: str  # "single" or "chat"
    workload: str
    arrivals: str
    load: float
    policy: str
    queue: bool
    seed: int
    size: int  # requests (single) or conversations (chat)
    dataset: str | None = None


@functools.lru_cache(maxsize=None)
def _capacity(workload: str, seed: int, size: int) -> float:
    node = spec()
    return capacity(node, saturation_sample(node, WORKLOADS[workload](size, np.random.default_rng(seed))))


@functools.lru_cache(maxsize=None)
def _chat_capacity(dataset: str | None) -> tuple[float, float]:
    """Turns/s the node sustains with the chats' turn sizes (no caching), and the mean turns per chat."""
    probe = _chats(dataset, 2000, 1.0, 99)
    turns = [RequestSpec(c.prompt_tokens(i), t.output_tokens) for c in probe for i, t in enumerate(c.turns)]
    node = spec()
    return capacity(node, saturation_sample(node, turns)), len(turns) / len(probe)


def _chats(dataset: str | None, n: int, rate: float, seed: int) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    if dataset is None:
        return conversations(n, rate, rng)
    return sharegpt_conversations(json.loads(Path(dataset).read_text(encoding="utf-8")), rate, rng, n)


def _policy(name: str) -> Any:
    return Pinned(make_policy("estimated_ttft")) if name == ORACLE else name


def run_task(task: Task) -> dict[str, Any]:
    """Run one task; its per-request latencies and its summary."""
    records: list[Record] = []
    max_requests, queue = (BATCH, QUEUE) if task.queue else (None, None)
    if task.section == "single":
        specs = WORKLOADS[task.workload](task.size, np.random.default_rng(task.seed))
        rate = task.load * _capacity(task.workload, task.seed, task.size)
        arrivals = ARRIVALS[task.arrivals](task.size, rate, np.random.default_rng(task.seed + 1))
        summary = run_routed(spec(), specs, arrivals, _policy(task.policy), task.seed, max_requests, queue,
                             keys="completions", records_out=records)
    else:
        cap, turns = _chat_capacity(task.dataset)
        chats = _chats(task.dataset, task.size, task.load * cap / turns, task.seed)
        summary = run_conversations(replace(spec(), prefix_caching=True), chats, _policy(task.policy), task.seed,
                                    max_requests, queue, records_out=records)
    done = [r for r in records if r.first_token is not None and r.finished is not None]
    return {"task": asdict(task), "summary": asdict(summary),
            "ttft": [r.first_token - r.arrival for r in done],  # type: ignore[operator]
            "e2e": [r.finished - r.arrival for r in done]}  # type: ignore[operator]


def _point(task: Task) -> tuple[str, str, str, float, str, bool]:
    return task.section, task.workload, task.arrivals, task.load, task.policy, task.queue


def pool(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point and policy: percentiles over the pooled requests of every seed, means of the rest."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault(_point(Task(**result["task"])), []).append(result)
    rows = []
    for (section, workload, arrivals, load, policy, queue), runs in groups.items():
        ttft = np.concatenate([r["ttft"] for r in runs])
        e2e = np.concatenate([r["e2e"] for r in runs])
        hits = _mean(runs, "hit_rate")
        rows.append({"section": section, "workload": workload, "arrivals": arrivals, "load": load,
                     "policy": policy, "queue": queue, "seeds": len(runs), "requests": int(ttft.size),
                     "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
                     "e2e_p50": float(np.percentile(e2e, 50)), "e2e_p99": float(np.percentile(e2e, 99)),
                     "tokens_s": _mean(runs, "tokens_s"), "imbalance": _mean(runs, "imbalance"),
                     "hit_rate": None if math.isnan(hits) else hits,
                     "rejected": int(sum(r["summary"]["rejected"] for r in runs))})
    return rows


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([r["summary"][key] for r in runs]))


def tasks(args: argparse.Namespace) -> list[Task]:
    loads = (0.95,) if args.quick else LOADS
    seeds = range(args.seeds)
    out = [Task("single", w, a, load, p, q, s, args.requests)
           for w in WORKLOADS for a in ARRIVALS for load in loads for p in POLICY_NAMES for q in (False, True)
           for s in seeds]
    chats = [("chat", None)] + ([("sharegpt-chat", args.sharegpt)] if args.sharegpt else [])
    out += [Task("chat", w, "poisson", load, p, q, s, args.conversations, d)
            for w, d in chats for load in loads for p in (*POLICY_NAMES, ORACLE) for q in (False, True)
            for s in seeds]
    return out


# -- the verdicts -------------------------------------------------------------------------------------------------
def _by(rows: list[dict[str, Any]], section: str) -> dict[tuple[Any, ...], dict[str, dict[str, Any]]]:
    points: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["section"] == section:
            points.setdefault((r["workload"], r["arrivals"], r["load"], r["queue"]), {})[r["policy"]] = r
    return points


def default_vs_others(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per single-turn point: the default's p99 TTFT against the best other policy's and round robin's."""
    out = []
    for (workload, arrivals, load, queue), by in sorted(_by(rows, "single").items()):
        others = {p: r["ttft_p99"] for p, r in by.items() if p != DEFAULT_POLICY}
        best = min(others, key=others.__getitem__)
        mine = by[DEFAULT_POLICY]["ttft_p99"]
        out.append({"workload": workload, "arrivals": arrivals, "load": load, "queue": queue, "default": mine,
                    "best_other": best, "best_other_p99": others[best], "ratio": mine / others[best],
                    "vs_round_robin": mine / others["round_robin"], "ok": mine <= BOUND * others[best]})
    return out


def chat_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per multi-turn point: the default's hit rate against the oracle's, its p99 TTFT against the best load-only."""
    out = []
    for (workload, arrivals, load, queue), by in sorted(_by(rows, "chat").items()):
        load_only = {p: by[p]["ttft_p99"] for p in LOAD_ONLY if p in by}
        best = min(load_only, key=load_only.__getitem__)
        mine = by[DEFAULT_POLICY]
        gap = by[ORACLE]["hit_rate"] - mine["hit_rate"]
        out.append({"workload": workload, "load": load, "queue": queue, "hit_rate": mine["hit_rate"],
                    "oracle_hit_rate": by[ORACLE]["hit_rate"], "gap_points": 100 * gap, "p99": mine["ttft_p99"],
                    "best_load_only": best, "best_load_only_p99": load_only[best],
                    "ok": gap <= 0.10 and mine["ttft_p99"] <= load_only[best]})
    return out


# -- output -------------------------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}"


def report(rows: list[dict[str, Any]]) -> str:
    verdicts = default_vs_others(rows)
    chat = chat_verdicts(rows)
    parts = [f"Default policy: `{DEFAULT_POLICY}`. Percentiles over every request of every seed.", "",
             f"**Single-turn: the default's p99 TTFT against the best other policy's** (bound: x{BOUND:.2f})", "",
             markdown_table(["workload", "arrivals", "load", "queue", "default p99 ms", "best other", "its p99 ms",
                             "ratio", "vs round robin", "within bound"],
                            [[v["workload"], v["arrivals"], f"{v['load']:.0%}", "on" if v["queue"] else "off",
                              _ms(v["default"]), v["best_other"], _ms(v["best_other_p99"]), f"{v['ratio']:.2f}",
                              f"{v['vs_round_robin']:.2f}", "yes" if v["ok"] else "**no**"] for v in verdicts]),
             "", "**Multi-turn chat: the default's prefix-cache hit rate against the oracle's, and its p99 TTFT "
             "against the best load-only policy's**", "",
             markdown_table(["workload", "load", "queue", "hit rate", "oracle", "gap (points)", "p99 ms",
                             "best load-only", "its p99 ms", "goal met"],
                            [[c["workload"], f"{c['load']:.0%}", "on" if c["queue"] else "off",
                              f"{c['hit_rate']:.1%}", f"{c['oracle_hit_rate']:.1%}", f"{c['gap_points']:.1f}",
                              _ms(c["p99"]), c["best_load_only"], _ms(c["best_load_only_p99"]),
                              "yes" if c["ok"] else "**no**"] for c in chat]),
             "", "**Every run**", "", table(rows)]
    return "\n".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    header = ["workload", "arrivals", "load", "policy", "queue", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 s",
              "e2e p99 s", "tok/s", "imbalance", "prefix hit rate"]
    body = [[r["workload"], r["arrivals"], f"{r['load']:.0%}", r["policy"], "on" if r["queue"] else "off",
             _ms(r["ttft_p50"]), _ms(r["ttft_p99"]), f"{r['e2e_p50']:.2f}", f"{r['e2e_p99']:.2f}",
             f"{r['tokens_s']:,.0f}", f"{r['imbalance']:.2f}",
             "" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"] for r in rows]
    return markdown_table(header, body)


def plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    policies = (*POLICY_NAMES, ORACLE)
    color = {p: f"C{i}" for i, p in enumerate(policies)}
    for metric, label, name in (("ttft_p99", "TTFT p99 (s)", "routing_ttft_p99.png"),
                                ("e2e_p99", "end-to-end p99 (s)", "routing_e2e_p99.png"),
                                ("imbalance", "load imbalance (max/mean outstanding tokens)", "routing_imbalance.png")):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for ax, (wname, aname) in zip(axes.flat, [(w, a) for w in WORKLOADS for a in ARRIVALS]):
            for policy in POLICY_NAMES:
                for queued, style in ((False, "-"), (True, "--")):
                    pts = sorted((r["load"], r[metric]) for r in rows if r["section"] == "single"
                                 and r["workload"] == wname and r["arrivals"] == aname and r["policy"] == policy
                                 and r["queue"] == queued)
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", color=color[policy],
                                lw=2.5 if policy == DEFAULT_POLICY else 1.2,
                                label=f"{policy}{' + queue' if queued else ''}")
            ax.set_title(f"{wname}, {aname}")
            ax.set_xlabel("offered load (fraction of capacity)")
            ax.set_ylabel(label)
            if metric != "imbalance":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=6)
        fig.suptitle(f"Routing: {REPLICAS} x OPT-1.3B (batch {BATCH}) on one simulated H100 64 GB; "
                     "solid: no admission queue, dashed: queue")
        fig.tight_layout()
        fig.savefig(figure_path(name), dpi=90)
        plt.close(fig)
    _plot_ratio(plt, rows)
    _plot_chat(plt, rows, color)


def _plot_ratio(plt: Any, rows: list[dict[str, Any]]) -> None:
    verdicts = default_vs_others(rows)
    if not verdicts:
        return
    fig, ax = plt.subplots(figsize=(12, 4.5))
    labels = [f"{v['workload'][:5]} {v['arrivals'][:5]} {v['load']:.0%} {'q' if v['queue'] else '-'}"
              for v in verdicts]
    x = np.arange(len(verdicts))
    ax.bar(x - 0.2, [v["ratio"] for v in verdicts], 0.4, label=f"{DEFAULT_POLICY} / best other policy")
    ax.bar(x + 0.2, [v["vs_round_robin"] for v in verdicts], 0.4, label=f"{DEFAULT_POLICY} / round_robin")
    ax.axhline(BOUND, color="red", ls="--", lw=1, label=f"bound x{BOUND:.2f}")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xticks(x, labels, rotation=70, fontsize=7)
    ax.set_ylim(0, 1.35)
    ax.set_ylabel("ratio of p99 TTFT")
    ax.set_title("The default's p99 TTFT against the best other policy and round robin, every single-turn point "
                 "(q: admission queue on)")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(figure_path("routing_default_ratio.png"), dpi=90)
    plt.close(fig)


def _plot_chat(plt: Any, rows: list[dict[str, Any]], color: dict[str, str]) -> None:
    chat = [r for r in rows if r["section"] == "chat"]
    if not chat:
        return
    workloads = sorted({r["workload"] for r in chat})
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, 4.2 * len(workloads)), squeeze=False)
    for row_axes, wname in zip(axes, workloads):
        for ax, (metric, label) in zip(row_axes, (("hit_rate", "prefix-cache hit rate"),
                                                  ("ttft_p99", "TTFT p99 (s)"), ("tokens_s", "tokens/s"))):
            for policy in (*POLICY_NAMES, ORACLE):
                for queued, style in ((False, "-"), (True, "--")):
                    pts = sorted((r["load"], r[metric] or 0.0) for r in chat if r["workload"] == wname
                                 and r["policy"] == policy and r["queue"] == queued)
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", color=color[policy],
                                lw=2.5 if policy in (DEFAULT_POLICY, ORACLE) else 1.2,
                                label=f"{policy}{' + queue' if queued else ''}")
            ax.set_title(f"{wname}: {label}")
            ax.set_xlabel("offered load (fraction of capacity, uncached)")
            if metric == "ttft_p99":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=8, fontsize=7)
    fig.suptitle("Multi-turn chat: 4 replicas with prefix caching; solid: no admission queue, dashed: queue")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(figure_path("routing_chat.png"), dpi=90)
    plt.close(fig)


def lora_rows(requests: int, seeds: int, loads: Iterable[float]) -> list[dict[str, Any]]:
    """Adapter-aware against adapter-blind routing at each load, pooled over seeds."""
    from sim.lora import LoraSim, run_adapters

    node, lora, rows = spec(), LoraSim(), []
    for load in loads:
        for aware in (True, False):
            runs = []
            for seed in range(seeds):
                rng = np.random.default_rng(seed)
                specs = mixed(requests, rng)
                arrivals = poisson_arrivals(requests, load * _capacity("mixed", seed, requests), rng)
                summary, stats = run_adapters(node, specs, arrivals, DEFAULT_POLICY, lora, aware, seed)
                runs.append({"summary": {**asdict(summary), **asdict(stats)}})
            rows.append({"load": load, "routing": "adapter-aware" if aware else "adapter-blind",
                         **{k: _mean(runs, k) for k in ("ttft_p50", "ttft_p99", "e2e_p99", "output_tokens_s",
                                                        "loads", "unloads", "overflows")},
                         "lora": asdict(lora)})
    return rows


def _ms1(x: float) -> str:
    return f"{x * 1e3:,.1f}"


def lora_report(rows: list[dict[str, Any]]) -> str:
    lora = rows[0]["lora"]
    head = (f"# LoRA: adapter-aware vs adapter-blind routing (simulated)\n\n{REPLICAS} x OPT-1.3B on an H100, "
            f"`mixed` workload, Poisson arrivals; {lora['adapters']} adapters, Zipf s = {lora['zipf_s']:g}, "
            f"{lora['max_loras']} slots per replica, {lora['load_s']:g} s a load; policy {DEFAULT_POLICY}.\n\n")
    return head + markdown_table(
        ["load", "routing", "TTFT p50", "TTFT p99", "E2E p99", "output tok/s", "loads", "unloads", "over cap"],
        [[f"{r['load']:.0%}", r["routing"], _ms1(r["ttft_p50"]), _ms1(r["ttft_p99"]), _ms(r["e2e_p99"]),
          f"{r['output_tokens_s']:.0f}", f"{r['loads']:.0f}", f"{r['unloads']:.0f}", f"{r['overflows']:.0f}"]
         for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per single-turn run (2000)")
    parser.add_argument("--conversations", type=int, default=2000, help="chats per multi-turn run (2000)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per point, pooled (3)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (1)")
    parser.add_argument("--sharegpt", metavar="FILE", help="also chats built from this ShareGPT-format file")
    parser.add_argument("--replot", action="store_true", help="only redraw the figures from docs/bench/routing.json")
    parser.add_argument("--quick", action="store_true",
                        help="only 95%% load, one seed, 600 requests and 400 chats (a smoke run)")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters: adapter-aware vs adapter-blind routing")
    args = parser.parse_args(argv)
    if args.lora:
        if args.quick:
            args.requests, args.seeds = 600, 1
        rows = lora_rows(args.requests, args.seeds, (0.95,) if args.quick else LOADS)
        text = lora_report(rows)
        save("routing_lora", {"rows": rows}, text)
        print(text)
        return
    if args.replot:
        plot(json.loads((RESULTS / "routing.json").read_text())["rows"])
        return
    if args.quick:
        args.requests, args.conversations, args.seeds = 600, 400, 1
    todo = tasks(args)
    started, cpu = time.perf_counter(), time.process_time()
    print(f"{len(todo)} runs on {args.jobs} process(es)")
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as workers:
            results = workers.map(run_task, todo, chunksize=1)
    else:
        results = [run_task(t) for t in todo]
    rows = pool(results)
    text = report(rows)
    save("routing", {"setup": {"replicas": REPLICAS, "max_num_seqs": BATCH, "utilization": UTIL,
                               "model": "opt-1.3b", "gpu": "H100-64GB", "requests_per_run": args.requests,
                               "conversations_per_run": args.conversations, "seeds": args.seeds,
                               "default_policy": DEFAULT_POLICY},
                     "verdicts": default_vs_others(rows), "chat_verdicts": chat_verdicts(rows), "rows": rows}, text)
    plot(rows)
    print(text.split("**Every run**")[0])
    print(f"{len(todo)} runs in {time.perf_counter() - started:.0f} s wall, {time.process_time() - cpu:.0f} s CPU "
          "(this process)")


if __name__ == "__main__":
    main()
