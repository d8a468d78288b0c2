"""Multi-turn chat through several gateways of several worker processes each, over the same replicas, one gateway
restarted mid-run: do conversations still find their prefix cache? (issue 17, item 4, on real vLLM-CPU)

Layouts (`--layouts`):
  one    one gateway, one process, no restart: the layout of bench.sim_vs_real's chat rows;
  fleet  `--gateways` gateways (2), each `gateway serve --workers W` (2) on its own port. The load generator sends
         each turn through the next gateway (`loadtest run --chat-hosts turn`: turn t of conversation c through
         gateway (c + t) mod G, as clients behind a load balancer that spreads requests), so no conversation stays
         with one gateway, and each gateway's workers take connections as the kernel spreads them. `--restart-at`
         seconds into the run gateway 0 is restarted without refusing anyone: a fresh gateway binds the same port
         (its workers' SO_REUSEPORT sockets), serves, then the old one gets SIGTERM and drains. Every turn through
         it after that meets processes with no memory of the conversations.
Each layout runs every policy (`--policies`: the default and `consistent_hash`, the sticky oracle that pins each
conversation to its rendezvous first choice whatever the load) for each seed, policies in a rotated order per seed,
prompts salted per (layout, seed, policy) so that no run finds another's conversations cached. The workload is
bench.sim_vs_real's chat: conversations starting as a Poisson process at `--rate` a second for `--duration`
seconds, 4 turns, a 128-token system prompt shared by all, 300-token messages, 64-token replies, 1 s think time.
The replicas' `vllm:prefix_cache_{hits,queries}_total` before a run, at the restart and after it give the run's hit
rate, and the hit rate of the turns after the restart; the records say which replica served each turn.

The replicas: a running `deploy up`'s (`--deployment RUN_DIR`), or two new ones from `deploy up --replicas 2 --model
tiny` (real vLLM-CPU); `--sim-config MODEL.json` serves `sim serve --config` replicas instead (the simulator, fast:
the test's). Item 4's goal: the default's hit rate within 5 points of sticky's in every layout.

    python -m bench.chat_gateways [--deployment RUN_DIR] [--seeds 3] [--out runs/chat_gateways] [--save]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from deploy.tinymodel import ensure_tiny_model

from .common import markdown_table, save
from .engine_speed import counters
from .sim_vs_real import CHAT, gateway_config, hash_text, process, python, serve_sim, spawn, stop
from .sim_vs_real_calibration import MODEL

LAYOUTS = ("one", "fleet")
POLICIES = ("prefix_affinity", "consistent_hash")
STICKY = "consistent_hash"
GOAL_POINTS = 5.0  # item 4: the default within this many points of sticky's hit rate
HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
SERVE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Run:
    layout: str
    seed: int
    policy: str

    @property
    def name(self) -> str:
        return f"{self.layout}-{self.seed}-{self.policy}"


@dataclass(frozen=True)
class Setup:
    seeds: int = 3
    layouts: tuple[str, ...] = LAYOUTS
    policies: tuple[str, ...] = POLICIES
    gateways: int = 2
    workers: int = 2
    rate: float = 1.5  # conversations a second
    duration: float = 36.0  # seconds of conversation starts: 42-63 conversations for seeds 0-5 at 1.5/s
    restart_at: float = 18.0  # seconds into a fleet run
    port: int = 18600

    def runs(self) -> list[Run]:
        out = []
        for layout in self.layouts:
            for seed in range(self.seeds):
                k = seed % len(self.policies)
                out += [Run(layout, seed, p) for p in self.policies[k:] + self.policies[:k]]
        return out


def wait_log(proc: subprocess.Popen[bytes], log: Path, done: Callable[[str], bool], who: str, goal: str,
             timeout_s: float = SERVE_TIMEOUT_S) -> float:
    """Seconds until `done(text of log)`; `who` exiting first, or `timeout_s` passing, is an error naming `goal`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{who} exited ({proc.returncode}) before {goal}; see {log}")
        if done(log.read_text(errors="replace") if log.exists() else ""):
            return time.monotonic() - start
        time.sleep(0.05)
    raise RuntimeError(f"{who} did not reach {goal} in {timeout_s:.0f} s; see {log}")


def wait_serving(proc: subprocess.Popen[bytes], log: Path, replicas: int) -> float:
    """Seconds until the gateway logs that it serves ("gateway on HOST:PORT", with or without workers) and that
    every replica is healthy (a gateway takes none as healthy before its first probe). Its log, not its port: the
    port may answer from the gateway it replaces."""
    return wait_log(proc, log, lambda text: "gateway on " in text and text.count(" is healthy") >= replicas,
                    "the gateway", "serving")


def wait_load_started(load: subprocess.Popen[bytes], log: Path) -> None:
    """Until the load generator logs (to its Locust log, `log`) that its schedule starts ("open loop: N
    conversations"): Locust's import and the tokenizer take seconds on a busy machine, and a restart timed from the
    spawn could come before the load (as it once did in the suite)."""
    wait_log(load, log, lambda text: "open loop: " in text, "the load generator", "its schedule")


def start_gateway(config: dict[str, Any], path: Path, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    path.write_text(yaml.safe_dump(config))
    proc = spawn([python(), "-m", "gateway.cli", "serve", "--config", str(path), "--host", "127.0.0.1"], log)
    try:
        return proc, wait_serving(proc, log, len(config["replicas"]))
    except BaseException:
        stop(proc)
        raise


def restart(old: subprocess.Popen[bytes], config: dict[str, Any], directory: Path, generation: int
            ) -> tuple[subprocess.Popen[bytes], dict[str, float]]:
    """A fresh gateway on the old one's port (SO_REUSEPORT), serving before the old one gets SIGTERM and drains."""
    new, serving_s = start_gateway(config, directory / f"gateway-0-{generation}.yaml",
                                   directory / f"gateway-0-{generation}.log")
    began = time.monotonic()
    stop(old)
    return new, {"serving_s": serving_s, "old_stopped_s": time.monotonic() - began}


@contextmanager
def fleet(base: dict[str, Any], replicas: Sequence[str], run: Run, setup: Setup, directory: Path
          ) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The run's gateways, serving: one process, or `setup.gateways` of `setup.workers` workers each."""
    count, workers = (1, 1) if run.layout == "one" else (setup.gateways, setup.workers)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for g in range(count):
            config = {**gateway_config(base, replicas, run.policy, setup.port + g), "workers": workers}
            procs.append(start_gateway(config, directory / f"gateway-{g}-0.yaml", directory / f"gateway-{g}-0.log")[0])
        yield procs
    finally:
        for proc in procs:
            stop(proc)


def measure(run: Run, setup: Setup, base: dict[str, Any], replicas: Sequence[str], tokenizer: str,
            directory: Path) -> dict[str, Any]:
    """One run: its gateways up, the chat load through them (a restart midway in a fleet), its figures."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "load"
    with fleet(base, replicas, run, setup, directory) as procs:
        hosts = [f"http://127.0.0.1:{setup.port + g}" for g in range(len(procs))]
        before = counters(replicas, HITS)
        argv = [python(), "-m", "loadtest.cli", "run", "--model", MODEL, "--out", str(out), "--no-plots",
                *(a for h in hosts for a in ("--host", h)), *CHAT, "--chat-hosts", "turn", "--arrival", "poisson",
                "--rate", f"{setup.rate:g}", "--duration", f"{setup.duration:g}", "--seed", str(run.seed),
                "--prompt-salt", str(hash_text(run.name)), "--tokenizer", tokenizer]
        load = spawn(argv, directory / "loadtest.log")
        restarted: dict[str, float] = {}
        at = None
        try:
            if run.layout == "fleet":
                wait_load_started(load, out / "locust.log")
                time.sleep(setup.restart_at)
                at = counters(replicas, HITS)
                restarted["at_unix"] = time.time()
                config = {**gateway_config(base, replicas, run.policy, setup.port), "workers": setup.workers}
                procs[0], timing = restart(procs[0], config, directory, 1)
                restarted.update(timing)
            code = load.wait(setup.duration + 600)
        finally:
            stop(load)
        if code != 0:
            raise RuntimeError(f"loadtest failed ({code}); see {directory / 'loadtest.log'}")
        after = counters(replicas, HITS)
        if restarted:  # the old gateway is gone: its port answers from the new one alone
            restarted["new_served"] = counters(hosts[:1], ["gateway_requests_total"])["gateway_requests_total"]
    return summarize(run, before, at, after, out, restarted)


def summarize(run: Run, before: dict[str, float], at: dict[str, float] | None, after: dict[str, float],
              out: Path, restarted: dict[str, float]) -> dict[str, Any]:
    """A run's row: hit counts (whole run, and from the restart on), turns, failures, placement, TTFTs."""
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line]
    started = json.loads((out / "meta.json").read_text())["started_unix"]
    ok = [r for r in records if r.get("ok")]
    chats: dict[int, list[tuple[int, str]]] = {}
    for r in ok:
        chats.setdefault(r["conversation"], []).append((r["turn"], r.get("replica") or "?"))
    served = [[replica for _, replica in sorted(turns)] for turns in chats.values()]
    later = [a == b for s in served for a, b in zip(s, s[1:])]
    row: dict[str, Any] = {
        **asdict(run), "finished_unix": time.time(), "turns": len(records), "failed": len(records) - len(ok),
        "errors": dict(Counter(r.get("error") for r in records if not r.get("ok"))),
        "conversations": len(chats), "hits": after[HITS[0]] - before[HITS[0]],
        "queries": after[HITS[1]] - before[HITS[1]], "same_replica": sum(later) / len(later) if later else math.nan,
        "chats_never_moved": sum(len(set(s)) == 1 for s in served),
        "ttft_s": [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]}
    if at is not None:
        row.update(hits_after=after[HITS[0]] - at[HITS[0]], queries_after=after[HITS[1]] - at[HITS[1]],
                   restart_s=restarted["at_unix"] - started, serving_s=restarted["serving_s"],
                   old_stopped_s=restarted["old_stopped_s"], new_served=restarted["new_served"],
                   turns_after=sum(r["sent_s"] >= restarted["at_unix"] - started for r in records))
    return row


def pooled(rows: Sequence[dict[str, Any]], hits: str = "hits", queries: str = "queries") -> float:
    q = sum(r.get(queries, 0.0) for r in rows)
    return sum(r.get(hits, 0.0) for r in rows) / q if q else math.nan


def measured(rows: Sequence[dict[str, Any]]) -> str:
    """The days the rows were measured on."""
    days = sorted({time.strftime("%Y-%m-%d", time.gmtime(r["finished_unix"])) for r in rows if "finished_unix" in r})
    return "Measured " + (" to ".join(dict.fromkeys((days[0], days[-1]))) if days else "on an unknown day")


def report(rows: Sequence[dict[str, Any]], setup: Setup, where: str) -> tuple[str, dict[str, Any]]:
    """The markdown report and its data: per layout and policy, pooled over the seeds; the goal's verdict."""
    table, verdict = [], {}
    for layout in setup.layouts:
        of = {p: [r for r in rows if r["layout"] == layout and r["policy"] == p] for p in setup.policies}
        sticky = pooled(of.get(STICKY, []))
        sticky_after = pooled(of.get(STICKY, []), "hits_after", "queries_after")
        for policy, mine in of.items():
            if not mine:
                continue
            rate, after = pooled(mine), pooled(mine, "hits_after", "queries_after")
            ttft = sorted(t for r in mine for t in r["ttft_s"])
            below = 100 * (sticky - rate)
            table.append([layout, policy, len(mine), sum(r["turns"] for r in mine), sum(r["failed"] for r in mine),
                          f"{100 * rate:.1f}%", f"{below:+.1f}" if policy != STICKY else "",
                          "" if math.isnan(after) else f"{100 * after:.1f}%",
                          "" if math.isnan(after) or policy == STICKY else f"{100 * (sticky_after - after):+.1f}",
                          f"{100 * float(np.mean([r['same_replica'] for r in mine])):.1f}%",
                          f"{1000 * float(np.percentile(ttft, 99)):.0f}" if ttft else ""])
            if policy != STICKY:
                verdict[f"{layout}/{policy}"] = {"points_below_sticky": below, "met": bool(below <= GOAL_POINTS)}
    header = ["layout", "policy", "seeds", "turns", "failed", "hit rate", "points below sticky",
              "hit rate after the restart", "points below sticky after it", "later turns on the previous turn's replica",
              "p99 TTFT ms"]
    restarts = [r for r in rows if r["layout"] == "fleet"]
    lines = [
        "# Multi-turn chat through several gateways and a restart", "",
        f"{measured(rows)}, `python -m bench.chat_gateways`, {where}: {setup.seeds} seeds, conversations starting as a Poisson process "
        f"at {setup.rate:g}/s for {setup.duration:g} s (4 turns, a shared 128-token system prompt, 300-token "
        f"messages, 64-token replies, 1 s think time). `one`: one gateway, one process. `fleet`: {setup.gateways} "
        f"gateways of {setup.workers} worker processes each, each turn through the next gateway, gateway 0 "
        f"restarted about {setup.restart_at:g} s in (a fresh one serves on its port, then the old one drains). Hit "
        "rates from the replicas' own counters, pooled over the seeds; \"after the restart\" counts the turns from "
        "the restart on. Item 4's goal: the default within 5 points of sticky (`consistent_hash`).", "",
        markdown_table(header, table), ""]
    if restarts:
        lines += [f"Restarts: the new gateway served {float(np.median([r['serving_s'] for r in restarts])):.1f} s "
                  f"after it was started (median), the old one stopped "
                  f"{float(np.median([r['old_stopped_s'] for r in restarts])):.1f} s after its SIGTERM; "
                  f"{sum(r['turns_after'] for r in restarts)} turns were sent after the restarts, "
                  f"{sum(r['new_served'] for r in restarts):.0f} of them served by the restarted gateways, "
                  f"{sum(r['failed'] for r in restarts)} of all the fleet runs' turns failed.", ""]
    lines.append("Per seed, hit rate (default / sticky): " + "; ".join(
        f"{layout} seed {seed}: " + " / ".join(
            f"{100 * r['hits'] / r['queries']:.1f}%" for p in setup.policies for r in rows
            if (r["layout"], r["seed"], r["policy"]) == (layout, seed, p) and r["queries"])
        for layout in setup.layouts for seed in range(setup.seeds)))
    met = bool(verdict) and all(v["met"] for v in verdict.values())
    lines += ["", f"**Goal {'met' if met else 'missed'}** in " + ", ".join(
        f"{k} ({v['points_below_sticky']:+.1f} points)" for k, v in verdict.items()) + "."]
    data = {"setup": asdict(setup), "where": where, "verdict": verdict, "met": met,
            "rows": [{k: v for k, v in r.items() if k != "ttft_s"} for r in rows]}
    return "\n".join(lines) + "\n", data


def where(args: argparse.Namespace) -> str:
    """What the replicas are, for the report."""
    if args.sim_config:
        return f"two `sim serve --config {args.sim_config}` replicas"
    return "two real vLLM-CPU replicas of the tiny model (`deploy up`)"


def replicas_of(stack: ExitStack, args: argparse.Namespace, out: Path, tokenizer: str
                ) -> tuple[dict[str, Any], list[str]]:
    """(the gateway config to start from, the replicas' URLs), the replicas started where none are given; simulated
    ones count prompt tokens with `tokenizer` (the tiny model's)."""
    if args.sim_config:
        urls, _ = serve_sim(stack, args.sim_config, 2, args.port + 50, out / "sim.log", tokenizer)
        return {"replicas": [{"url": u, "max_num_seqs": 32} for u in urls]}, urls
    run_dir = args.deployment or out / "deploy"
    if args.deployment is None:
        stack.enter_context(process(
            [python(), "-m", "deploy.cli", "up", "--replicas", "2", "--model", "tiny", "--port", str(args.port + 40),
             "--replica-port-base", str(args.port + 50), "--run-dir", str(run_dir), "--host", "127.0.0.1"],
            out / "deploy.log", f"http://127.0.0.1:{args.port + 40}/ready", 900))
    base = yaml.safe_load((run_dir / "gateway.yaml").read_text())
    return base, [r["url"] for r in base["replicas"]]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.chat_gateways", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="worker processes per gateway in the fleet")
    parser.add_argument("--rate", type=float, default=1.5, help="conversations starting a second")
    parser.add_argument("--duration", type=float, default=36.0, help="seconds of conversation starts")
    parser.add_argument("--restart-at", type=float, default=18.0, help="seconds into a fleet run")
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--deployment", type=Path, help="a running `deploy up`'s run directory (its replicas)")
    parser.add_argument("--sim-config", help="serve `sim serve --config FILE` replicas instead (the simulator)")
    parser.add_argument("--out", type=Path, default=Path("runs/chat_gateways"))
    parser.add_argument("--save", action="store_true", help="write docs/bench/chat_gateways.{md,json}")
    args = parser.parse_args(argv)
    layouts = tuple(x for x in args.layouts.split(",") if x)
    policies = tuple(x for x in args.policies.split(",") if x)
    if not layouts or set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts: choose from {', '.join(LAYOUTS)}")
    if STICKY not in policies or len(policies) < 2:
        parser.error(f"--policies: {STICKY} (the sticky oracle) and at least one other")
    if args.seeds < 1 or args.gateways < 1 or args.workers < 1 or args.rate <= 0 or args.duration <= 0:
        parser.error("--seeds, --gateways and --workers must be >= 1, --rate and --duration > 0")
    if "fleet" in layouts and not 0 < args.restart_at < args.duration:
        parser.error("--restart-at must fall inside --duration")
    setup = Setup(args.seeds, layouts, policies, args.gateways, args.workers, args.rate, args.duration,
                  args.restart_at, args.port)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "runs.jsonl"
    done = {Run(r["layout"], r["seed"], r["policy"]): r for r in map(json.loads, results.read_text().splitlines())
            } if results.exists() else {}
    tokenizer = str(ensure_tiny_model())
    with ExitStack() as stack:
        pending = [run for run in setup.runs() if run not in done]  # a rerun in the same --out measures the rest
        base, replicas = replicas_of(stack, args, args.out, tokenizer) if pending else ({}, [])
        for run in pending:
            row = measure(run, setup, base, replicas, tokenizer, args.out / "runs" / run.name)
            done[run] = row
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            rate = row["hits"] / row["queries"] if row["queries"] else math.nan
            print(f"{run.name}: {row['turns']} turns, {row['failed']} failed, hit rate {100 * rate:.1f}%", flush=True)
    text, data = report([done[r] for r in setup.runs()], setup, where(args))
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)
    if args.save:
        save("chat_gateways", data, text)


if __name__ == "__main__":
    main()
