"""Calibration against the reference: OPT-1.3B on an H100 64 GB, vLLM 0.5.2 (V0), ShareGPT prompts all at t=0.

The experiment is replayed in virtual time: `n` ShareGPT-like requests (see `workload.sharegpt_like`) arrive at
once, split round-robin across the replicas, each replica with `gpu_memory_utilization 0.9/N`; throughput is
(prompt + output tokens) / time to the last completion, as vLLM's benchmark_serving reports it.

Three step-time constants are fitted (`fit`): the host overhead per step and per sequence, and the fraction of
peak memory bandwidth the forward pass gets. The objective is the squared log error of total tokens/s at each
batch cap of the single-instance curve plus the squared error of the two-replica gain at batch 256 (weighted as
much as the whole curve). Nothing is tabulated: the simulator only ever sees the three constants.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .clock import VirtualClock
from .engine import SimRequest
from .gpus import GpuSpec, get_gpu
from .model import ModelSpec, load_model
from .node import Node, NodeSpec
from .steptime import StepCost
from .workload import RequestSpec, sharegpt_like

DATA = Path(__file__).parent / "data"
SINGLE_CSV = DATA / "bca-opt-1.3b-h100-single.csv"
REPLICATION_CSV = DATA / "bca-opt-1.3b-h100-replication.csv"
REFERENCE_REQUESTS = 2000
REFERENCE_GAIN = 0.35  # two replicas at batch 256 over one instance at 256


@dataclass(frozen=True)
class RunResult:
    """What benchmark_serving would report for one simulated run."""

    max_num_seqs: int
    replicas: int
    requests: int
    total_tok_s: float
    output_tok_s: float
    req_s: float
    mean_tpot_ms: float
    mean_ttft_ms: float
    preemptions: int
    kv_blocks_each: int
    duration_s: float


def read_reference(path: Path) -> list[dict[str, str]]:
    """Rows of a reference CSV (lines starting with # are comments)."""
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def requests_for(max_num_seqs: int) -> int:
    """Requests to simulate at a batch cap: the reference's 2000 from batch 80 up; fewer (steady state) below."""
    return min(REFERENCE_REQUESTS, max(200, 25 * max_num_seqs))


def run_all_at_once(model: ModelSpec, gpu: GpuSpec, cost: StepCost, max_num_seqs: int, replicas: int,
                    specs: Sequence[RequestSpec], utilization: float = 0.9,
                    max_num_batched_tokens: int | None = None, chunked_prefill: bool = False) -> RunResult:
    """Every request at t=0, pre-assigned round-robin; one GPU shared by `replicas` vLLM instances."""
    clock = VirtualClock()
    node = Node(NodeSpec(model, gpu, replicas, max_num_seqs, utilization / replicas, max_num_batched_tokens,
                         chunked_prefill, cost), clock)
    engines = node.engines
    blocks = node.engine_config.num_gpu_blocks
    requests = [SimRequest(s.prompt_tokens, s.output_tokens) for s in specs]
    for i, req in enumerate(requests):
        engines[i % replicas].add(req)
    clock.run()
    return summarize(requests, max_num_seqs, replicas, blocks, sum(e.num_preemptions for e in engines))


def summarize(requests: Sequence[SimRequest], max_num_seqs: int, replicas: int, blocks: int,
              preemptions: int) -> RunResult:
    done = [r for r in requests if r.finished_at is not None and r.first_token_at is not None]
    ends = [(r.first_token_at or 0.0, r.finished_at or 0.0) for r in done]
    duration = max(end for _, end in ends)
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.max_tokens for r in done)
    tpots = [(end - first) / (r.max_tokens - 1) for r, (first, end) in zip(done, ends) if r.max_tokens > 1]
    ttfts = [first - r.arrival for r, (first, _) in zip(done, ends)]
    return RunResult(max_num_seqs, replicas, len(done), (prompt + output) / duration, output / duration,
                     len(done) / duration, 1e3 * float(np.mean(tpots)), 1e3 * float(np.mean(ttfts)),
                     preemptions, blocks, duration)


@dataclass(frozen=True)
class Calibration:
    """The reference setup: model, GPU, workload seed."""

    model: ModelSpec
    gpu: GpuSpec
    seed: int = 0

    @classmethod
    def reference(cls, seed: int = 0) -> Calibration:
        return cls(load_model("opt-1.3b"), get_gpu("H100-64GB"), seed)

    def specs(self, n: int) -> list[RequestSpec]:
        return sharegpt_like(n, np.random.default_rng(self.seed))

    def single(self, cost: StepCost, max_num_seqs: int) -> RunResult:
        return run_all_at_once(self.model, self.gpu, cost, max_num_seqs, 1, self.specs(requests_for(max_num_seqs)))

    def replicated(self, cost: StepCost, max_num_seqs: int, replicas: int) -> RunResult:
        return run_all_at_once(self.model, self.gpu, cost, max_num_seqs, replicas, self.specs(REFERENCE_REQUESTS),
                               utilization=0.9)


@dataclass(frozen=True)
class Comparison:
    """Simulated against reference, one row per batch cap (single) or setup (replication)."""

    single: list[tuple[int, float, RunResult]]  # (batch cap, reference total tok/s, simulated)
    replication: list[tuple[int, int, float, RunResult]]  # (batch cap, replicas, reference tok/s, simulated)

    def single_errors(self) -> list[float]:
        return [sim.total_tok_s / ref - 1 for _, ref, sim in self.single]

    def gain(self, max_num_seqs: int = 256, replicas: int = 2) -> float:
        one = next(s for b, n, _, s in self.replication if b == max_num_seqs and n == 1)
        many = next(s for b, n, _, s in self.replication if b == max_num_seqs and n == replicas)
        return many.total_tok_s / one.total_tok_s - 1


def compare(cost: StepCost | None = None, calibration: Calibration | None = None,
            batch_caps: Sequence[int] | None = None) -> Comparison:
    """Run the reference's single-instance sweep and its 1/2/4-replica setups in the simulator."""
    cost = cost or StepCost()
    cal = calibration or Calibration.reference()
    single = [(int(row["max_num_seqs"]), float(row["total_tok_s"])) for row in read_reference(SINGLE_CSV)]
    if batch_caps is not None:
        single = [(b, ref) for b, ref in single if b in batch_caps]
    rows = [(b, ref, cal.single(cost, b)) for b, ref in single]
    repl = []
    for row in read_reference(REPLICATION_CSV):
        b, n = int(row["max_num_seqs"]), int(row["replicas"])
        if batch_caps is None or b in batch_caps:
            repl.append((b, n, float(row["total_tok_s"]), cal.replicated(cost, b, n)))
    return Comparison(rows, repl)


def objective(cost: StepCost, cal: Calibration, caps: Sequence[int]) -> float:
    """Squared log error over the single curve plus the gain error (as heavy as the whole curve)."""
    single = {int(r["max_num_seqs"]): float(r["total_tok_s"]) for r in read_reference(SINGLE_CSV)}
    err = [math.log(cal.single(cost, b).total_tok_s / single[b]) ** 2 for b in caps]
    gain = cal.replicated(cost, 256, 2).total_tok_s / cal.single(cost, 256).total_tok_s - 1
    return float(np.mean(err)) + ((gain - REFERENCE_GAIN) / (1 + REFERENCE_GAIN)) ** 2


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: np.ndarray, iters: int = 60) -> np.ndarray:
    """A small Nelder-Mead minimizer (no SciPy here)."""
    simplex = [x0] + [x0 + np.eye(len(x0))[i] * step[i] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    best: np.ndarray = simplex[int(np.argmin(values))]
    return best


def fit(start: StepCost | None = None, calibration: Calibration | None = None,
        caps: Sequence[int] = (1, 8, 32, 64, 128, 256, 512, 768), iters: int = 40) -> StepCost:
    """Fit host_step_s, host_per_seq_s and mem_efficiency (flop_efficiency stays as given)."""
    start = start or StepCost()
    cal = calibration or Calibration.reference()

    def cost_of(x: np.ndarray) -> StepCost:
        return replace(start, host_step_s=float(abs(x[0])) * 1e-3, host_per_seq_s=float(abs(x[1])) * 1e-6,
                       mem_efficiency=float(min(1.0, abs(x[2]))))

    x0 = np.array([start.host_step_s * 1e3, start.host_per_seq_s * 1e6, start.mem_efficiency])
    best = nelder_mead(lambda x: objective(cost_of(x), cal, caps), x0, np.array([0.3, 8.0, 0.1]), iters)
    return cost_of(best)


def format_table(comparison: Comparison, cost: StepCost) -> str:
    """The comparison as Markdown tables (what docs/sim.md shows)."""
    lines = [f"Constants: host_step_s={cost.host_step_s * 1e3:.3g} ms, host_per_seq_s={cost.host_per_seq_s * 1e6:.3g}"
             f" us, mem_efficiency={cost.mem_efficiency:.3g}, flop_efficiency={cost.flop_efficiency:.3g} (assumed)",
             "", "| max_num_seqs | reference tok/s | simulated tok/s | error | sim mean TPOT ms | sim KV blocks |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b, ref, sim in comparison.single:
        lines.append(f"| {b} | {ref:,.0f} | {sim.total_tok_s:,.0f} | {sim.total_tok_s / ref - 1:+.1%} | "
                     f"{sim.mean_tpot_ms:.1f} | {sim.kv_blocks_each:,} |")
    lines += ["", "| max_num_seqs | replicas | reference tok/s | simulated tok/s | error | sim preemptions | "
              "sim KV blocks each |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for b, n, ref, sim in comparison.replication:
        lines.append(f"| {b} | {n} | {ref:,.0f} | {sim.total_tok_s:,.0f} | {sim.total_tok_s / ref - 1:+.1%} | "
                     f"{sim.preemptions} | {sim.kv_blocks_each:,} |")
    lines += ["", f"Two replicas at batch 256 over one: simulated {comparison.gain():+.1%}, reference "
              f"{REFERENCE_GAIN:+.0%}."]
    return "\n".join(lines)
