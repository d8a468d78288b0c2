"""One step-time model across models and GPUs, fitted to measured engine steps, with leave-one-model-out errors.

The data (`planner/data/stepdata/`, provenance in each CSV's header) are real engine runs: steady-state vLLM
windows of OPT-1.3B to Llama-2-13B on an H100 64 GB (vLLM 0.5.2), whole-batch latencies of 7-8B models on an
A100 40 GB, an H100 80 GB and a GH200, Qwen's published single-request speeds of Qwen2.5-0.5B to -14B on an A100 80
GB (vLLM 0.6.3), this project's own closed loops of OPT-1.3B and Qwen3-1.7B on an H200 (vLLM 0.26.0,
docs/bench/gpu/), and NVIDIA's published static-batch latencies of GPT-350M to GPT-20B with FasterTransformer 5.0
on an A100 80 GB (another engine: its constants are fitted apart from vLLM's on that card), and PaddleNLP's
published FastGeneration latencies of GPT-2 (124M) to GPT-2 large, OPT-125M and OPT-350M on a V100 (two builds, each
fitted apart). Each measurement is
turned into the engine steps it consisted of (so many prefill steps of this size, so many decode steps of that batch
and context), and the model prices every step as `sim/steptime.py` does, with four constants per GPU:

    step_s = host_step_s x layers / 32 + host_per_seq_s x seqs + max(bytes / bandwidth, flops / flop_rate)
    bytes  = weights read + KV bytes/token x (tokens of context read + new tokens written)
    flops  = 2 x layer params x new tokens + 2 x lm_head params x sampled + 4 x layers x width x attention pairs

`bandwidth` and `flop_rate` are effective rates (datasheet x efficiency); nothing is fitted per model. A step's
fixed cost grows with the model's layers (kernels launched and run one after another per layer): `host_step_s` is a
32-layer model's (`--host-fixed`: one time for every model, the form before 2026-12-01; docs/sim.md compares them).
Where a GPU's data never vary the batch (Qwen's A100 80 GB rows, one request each), a cost per sequence cannot be
told from one per step: it is not fitted there, but 0. Runs whose decode
took a kernel that does not stream the KV cache at the card's bandwidth (vLLM V0's PagedAttention V1 over several
partitions, which V0 used for sliding-window models at large batches) are kept but marked `outside`: not fitted,
not judged, their errors reported apart. The fit minimizes
a Huber loss of the log error of each measurement's total time, per GPU, by Nelder-Mead
(`sim.calibrate.nelder_mead`).

    python -m sim.stepfit        # or: sim stepfit; the held-out error table of docs/sim.md
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from synthetic.arch import load_spec, read_config

from .calibrate import nelder_mead
from .gpus import GIB, GpuSpec, get_gpu
from .memory import BLOCK_SIZE, num_gpu_blocks
from .model import ModelSpec
from .steptime import StepCost

DATA_DIR = Path(__file__).resolve().parent.parent / "planner" / "data" / "stepdata"
BSC_FILE = "bsc-vllm052-h100-64gb.csv"
ARGONNE_FILE = "argonne-vllm-e2e.csv"
OWN_FILE = "own-vllm026-h200.csv"  # this project's own GPU runs (vLLM 0.26.0 on an H200), not a public source
QWEN_FILE = "qwen-vllm063-a100-80gb.csv"
FT_FILE = "fastertransformer50-a100-80gb.csv"  # another engine: its constants are fitted apart (`Measurement.setup`)
FT_ENGINE = "FasterTransformer 5.0"
PADDLE_FILE = "paddlenlp-fastgen-v100-16gb.csv"  # two builds of one more engine, each fitted apart
PADDLE_ENGINE = "PaddleNLP FastGeneration"
# GH200 (Grace Hopper, 96 GB HBM3 part): 4.0 TB/s, the H100's 989 TFLOP/s dense bf16. A100 80 GB (SXM4: 2.039 TB/s
# HBM2e, 312 TFLOP/s; the Qwen source does not say SXM or PCIe, whose 1.935 TB/s the fitted bandwidth absorbs). Not
# in sim/gpus.py because only this fit uses them.
EXTRA_GPUS = {"GH200": GpuSpec("GH200", 96 * GIB, 4.0e12, 989e12),
              "A100-80GB": GpuSpec("A100-80GB", 80 * GIB, 2.039e12, 312e12),
              "V100-16GB": GpuSpec("V100-16GB", 16 * GIB, 900e9, 125e12)}  # SXM2: HBM2, FP16 tensor cores
DECODE_BINS = 16  # a batch's decode steps are priced at this many context lengths (midpoints); exact while linear
HUBER_DELTA = 0.05
PREFILL_BUDGET_CAP = 32768  # vLLM caps max_num_batched_tokens by max_model_len; long-context models chunk
PARTITION_SIZE = 512  # vLLM V0's PagedAttention V2 splits a context into partitions of this many tokens
LAYER_REF = 32  # host_step_s is a 32-layer model's, and a model's is scaled by its layers


@dataclass(frozen=True)
class Steps:
    """`count` identical engine steps: new tokens, sampled sequences, KV tokens read, attention pairs, sequences."""

    count: float
    new_tokens: float
    sampled: float
    kv_read: float
    attn_pairs: float
    seqs: float


@dataclass(frozen=True)
class Measurement:
    """One measured wall time and the steps it consisted of."""

    source: str
    gpu: str
    model: str
    label: str
    measured_s: float
    steps: tuple[Steps, ...]
    spec: ModelSpec = field(repr=False)
    outside: str = ""  # why the model does not describe this run's kernels; empty when it does
    engine: str = ""  # empty: vLLM. Another engine's host time is its own, so its constants are fitted apart

    @property
    def setup(self) -> str:
        """What one set of constants is fitted to: the GPU, and the engine where it is not vLLM."""
        return f"{self.gpu}, {self.engine}" if self.engine else self.gpu


@dataclass(frozen=True)
class GpuConstants:
    """The four fitted constants of one GPU (effective rates, not datasheet ones), and the form of the host time."""

    bandwidth_bps: float
    flop_rate: float
    host_step_s: float  # a `host_layers`-layer model's fixed time a step; every model's where host_layers is 0
    host_per_seq_s: float
    host_layers: int = LAYER_REF  # 0: one fixed time a step for every model (`sim stepfit --host-fixed`)

    @classmethod
    def from_vector(cls, x: np.ndarray, host_layers: int = LAYER_REF) -> GpuConstants:
        """From log-space parameters: log TB/s, log PFLOP/s, log ms, and log us (absent: no cost per sequence)."""
        e = np.exp(x)
        per_seq = float(e[3]) * 1e-6 if len(e) > 3 else 0.0
        return cls(float(e[0]) * 1e12, float(e[1]) * 1e15, float(e[2]) * 1e-3, per_seq, host_layers)

    def vector(self) -> np.ndarray:
        return np.log([self.bandwidth_bps / 1e12, self.flop_rate / 1e15, self.host_step_s * 1e3,
                       self.host_per_seq_s * 1e6])

    def capped(self, gpu: GpuSpec) -> GpuConstants:
        """At most the datasheet's bandwidth and FLOP/s: a rate the data do not pin (no step compute-bound) stays a
        rate the card has."""
        return replace(self, bandwidth_bps=min(self.bandwidth_bps, gpu.bandwidth_bps),
                       flop_rate=min(self.flop_rate, gpu.peak_flops))

    def host_scale(self, layers: np.ndarray | int) -> np.ndarray:
        """What host_step_s is multiplied by for models of these layer counts (one count, or an array of them)."""
        return np.asarray(layers, dtype=float) / self.host_layers if self.host_layers else \
            np.ones_like(layers, dtype=float)

    def step_cost(self, gpu: GpuSpec, model: ModelSpec) -> StepCost:
        """The simulator's StepCost for `model` on `gpu` (efficiencies must come out at most 1)."""
        host = self.host_step_s * float(self.host_scale(model.num_layers))
        return StepCost(host, self.host_per_seq_s, self.bandwidth_bps / gpu.bandwidth_bps,
                        self.flop_rate / gpu.peak_flops)


def gpu_spec(name: str) -> GpuSpec:
    """A GPU of sim/gpus.py, or one this fit adds (GH200)."""
    return EXTRA_GPUS[name] if name in EXTRA_GPUS else get_gpu(name)


def config_source(name: str, data_dir: Path = DATA_DIR) -> str:
    """Where NAME's config.json is: `data_dir/configs/NAME`, else a shipped one (synthetic/configs)."""
    local = data_dir / "configs" / name / "config.json"
    return str(local) if local.is_file() else name


def model_spec(name: str, data_dir: Path = DATA_DIR) -> ModelSpec:
    """NAME's shape, from its config (`config_source`)."""
    return load_spec(config_source(name, data_dir))


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The `#` header lines (provenance) and the rows of one data file."""
    lines = path.read_text().splitlines()
    header = [line[1:].strip() for line in lines if line.startswith("#")]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    if not header or not rows:
        raise ValueError(f"{path}: expected '#' provenance lines and data rows")
    return header, rows


# --- turning each measurement into steps -----------------------------------------------------------------------


def bsc_steps(row: dict[str, str]) -> tuple[Steps, ...]:
    """A steady-state window of vLLM V0 with a full batch: decode steps, and prefill steps of the prompts admitted.

    Admitted prompts = prompt tokens / mean prompt length; each also got its first token from its prefill, so decode
    steps = (generated - admitted) / batch. A prefill step runs whenever some sequence finished in the decode step
    before it; with `a` admissions over `n` decode steps that is n (1 - exp(-a/n)) prefill steps (Poisson).
    """
    batch, prompt = float(row["mean_running"]), float(row["prompt_tokens"])
    mean_prompt = float(row["mean_prompt_tokens"])
    admitted = prompt / mean_prompt
    n_dec = (float(row["generation_tokens"]) - admitted) / batch
    context = float(row["mean_kv_usage"]) * int(row["num_gpu_blocks"]) * BLOCK_SIZE / batch
    n_pre = n_dec * -math.expm1(-admitted / n_dec) if admitted > 0 else 0.0
    decode = Steps(n_dec, batch, batch, batch * context, batch * context, batch)
    if n_pre <= 0:
        return (decode,)
    per = admitted / n_pre
    prefill = Steps(n_pre, prompt / n_pre, per, 0.0, per * mean_prompt * (mean_prompt + 1) / 2, per)
    return decode, prefill


def argonne_steps(spec: ModelSpec, batch: int, io_len: int) -> tuple[Steps, ...]:
    """One offline batch: B prompts of L tokens prefilled (as many per step as the token budget allows), then L-1
    decode steps of B sequences whose context grows from L+1 to 2L-1."""
    return batch_steps(spec, batch, io_len, io_len)


def batch_steps(spec: ModelSpec, batch: int, prompt: int, out: int) -> tuple[Steps, ...]:
    """One offline batch: B prompts of P tokens prefilled (as many per step as the token budget allows), then O-1
    decode steps of B sequences whose context grows from P+1 to P+O-1 (the prefill gave each its first token)."""
    budget = max(min(spec.max_model_len, PREFILL_BUDGET_CAP), 2048)
    per_step = max(1, budget // prompt)
    full, rest = divmod(batch, per_step)
    steps = [Steps(full, per_step * prompt, per_step, 0.0, per_step * prompt * (prompt + 1) / 2, per_step)]
    if rest:
        steps.append(Steps(1, rest * prompt, rest, 0.0, rest * prompt * (prompt + 1) / 2, rest))
    steps += decode_steps(batch, prompt + 1, out - 1)
    return tuple(s for s in steps if s.count > 0)


def decode_steps(batch: int, first_context: int, out: int) -> tuple[Steps, ...]:
    """`out` decode steps of `batch` sequences, one token each, whose contexts attended grow from `first_context` to
    `first_context + out - 1` (priced at DECODE_BINS midpoints)."""
    edges = np.linspace(first_context, first_context + out, DECODE_BINS + 1)
    return tuple(Steps(out / DECODE_BINS, batch, batch, batch * ctx, batch * ctx, batch)
                 for ctx in (edges[:-1] + edges[1:]) / 2)


def static_batch_steps(batch: int, prompt: int, out: int) -> tuple[Steps, ...]:
    """FasterTransformer's static batch: one context pass over all B x P prompt tokens (its KV written, no LM head),
    then O decode steps of B sequences, the first of which runs the last prompt token again and samples the first
    output (ParallelGpt.cc: the context decoder caches P - 1 tokens; the steps run from P to P + O - 1), so the
    contexts attended grow from P to P + O - 1."""
    return (Steps(1, batch * prompt, 0, 0.0, batch * prompt * (prompt + 1) / 2, batch),
            *decode_steps(batch, prompt, out))


@dataclass(frozen=True)
class ClosedLoop:
    """One closed-loop point of `planner profile` (B clients, each sending its next request when its last ends):
    what its mean engine step is made of."""

    clients: float
    input_tokens: int
    output_tokens: int
    req_s: float
    ttft_mean_s: float
    e2e_mean_s: float
    step_s: float  # the mean time per output token after the first: one token per running sequence a step

    @classmethod
    def of_row(cls, row: dict[str, str]) -> ClosedLoop:
        """A row of OWN_FILE."""
        return cls(float(row["clients"]), int(row["input_tokens"]), int(row["output_tokens"]), float(row["req_s"]),
                   float(row["ttft_mean_ms"]) / 1e3, float(row["e2e_mean_ms"]) / 1e3,
                   float(row["tpot_mean_ms"]) / 1e3)

    @property
    def batch(self) -> float:
        """The sequences decoding at once, by Little's law: requests/s x mean time from first token to last, at
        most B. The H200 runs decoded about 75 at "B = 256": their client held 100 requests at the replica, the
        rest waiting for a connection before their first token (docs/bench/gpu/README.md, the correction), which
        this count, taken after the first token, leaves out."""
        return min(self.clients, self.req_s * (self.e2e_mean_s - self.ttft_mean_s))

    @property
    def arriving(self) -> float:
        """Prompts arriving during one step (requests/s x the step), prefilled in it: vLLM V1 mixes chunked
        prefills into its decode steps."""
        return self.req_s * self.step_s

    def steps(self) -> tuple[Steps, ...]:
        """The mean step: `batch` sequences each at the middle of its output, and the arriving prompts."""
        batch, new, prompt = self.batch, self.arriving, self.input_tokens
        context = prompt + self.output_tokens / 2
        return (Steps(1.0, batch + new * prompt, batch + new, batch * context,
                      batch * context + new * prompt * (prompt + 1) / 2, batch + new),)


def v0_paged_decode(name: str, data_dir: Path = DATA_DIR) -> bool:
    """Whether vLLM 0.5-0.6 (V0) decoded this model with its own PagedAttention kernel instead of FlashAttention.

    V0 fell back to the XFormers backend for every model with a sliding window ("Cannot use FlashAttention-2 backend
    due to sliding window", vllm/attention/selector.py of 0.5.0-0.6.x); a window the config turns off
    (`use_sliding_window: false`, Qwen) is none, as vLLM's `get_hf_config_sliding_window` reads it.
    """
    cfg = read_config(config_source(name, data_dir))
    return cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False


def single_block_decode(spec: ModelSpec, batch: int, io_len: int) -> bool:
    """Whether V0's PagedAttention took V1 over a context of several partitions in some decode step of this batch:
    V1 (one thread block per sequence and query head, over the whole context) whenever num_seqs x num_heads > 512,
    V2 (partitions of 512 tokens in parallel, then a reduction) below that (vllm/attention/ops/paged_attn.py,
    `use_v1 = max_seq_len <= 8192 and (max_num_partitions == 1 or num_seqs * num_heads > 512)`)."""
    return batch * spec.num_heads > 512 and 2 * io_len - 1 > PARTITION_SIZE


def kv_fits(spec: ModelSpec, gpu: GpuSpec, batch: int, io_len: int) -> bool:
    """Whether B x 2L tokens of KV fit in vLLM's cache (0.9 of memory, with a 10% margin): else vLLM preempts and
    recomputes, which is not a step-time question."""
    blocks = num_gpu_blocks(spec, gpu, 0.9, 256)
    return batch * 2 * io_len <= 0.9 * blocks * BLOCK_SIZE


def load_bsc(path: Path, data_dir: Path = DATA_DIR) -> list[Measurement]:
    _, rows = read_csv(path)
    specs = {name: model_spec(name, data_dir) for name in {r["model"] for r in rows}}
    return [Measurement("bsc", "H100-64GB", r["model"], f"B={r['max_num_seqs']}", float(r["window_s"]),
                        bsc_steps(r), specs[r["model"]]) for r in rows]


def load_argonne(path: Path, data_dir: Path = DATA_DIR) -> list[Measurement]:
    _, rows = read_csv(path)
    specs = {name: model_spec(name, data_dir) for name in {r["model"] for r in rows}}
    paged = {name: v0_paged_decode(name, data_dir) for name in specs}
    out = []
    for r in rows:
        spec, batch, io_len = specs[r["model"]], int(r["batch"]), int(r["io_len"])
        if 2 * io_len <= spec.max_model_len and kv_fits(spec, gpu_spec(r["gpu"]), batch, io_len):
            outside = ("decoded by V0's PagedAttention V1 over several partitions"
                       if paged[r["model"]] and single_block_decode(spec, batch, io_len) else "")
            out.append(Measurement("argonne", r["gpu"], r["model"], f"B={batch} L={io_len}", float(r["latency_s"]),
                                   argonne_steps(spec, batch, io_len), spec, outside))
    return out


def load_own(path: Path, data_dir: Path = DATA_DIR) -> list[Measurement]:
    """This project's H200 runs: one measurement per closed-loop point, its mean step (`ClosedLoop`)."""
    _, rows = read_csv(path)
    specs = {name: model_spec(name, data_dir) for name in {r["model"] for r in rows}}
    loops = [(r, ClosedLoop.of_row(r)) for r in rows]
    return [Measurement("own", "H200", r["model"], f"{r['run']} B={r['clients']}", loop.step_s, loop.steps(),
                        specs[r["model"]]) for r, loop in loops]


def load_qwen(path: Path, data_dir: Path = DATA_DIR) -> list[Measurement]:
    """Qwen's published vLLM speeds: one request of P prompt tokens generating O tokens, its time O / speed."""
    _, rows = read_csv(path)
    specs = {name: model_spec(name, data_dir) for name in {r["model"] for r in rows}}
    return [Measurement("qwen", r["gpu"], r["model"], f"B=1 P={r['input_len']}",
                        int(r["output_len"]) / float(r["speed_tok_s"]),
                        batch_steps(specs[r["model"]], 1, int(r["input_len"]), int(r["output_len"])), specs[r["model"]])
            for r in rows]


def load_ft(path: Path, data_dir: Path = DATA_DIR) -> list[Measurement]:
    """FasterTransformer's published latencies of one static batch (`static_batch_steps`), fitted apart from vLLM's."""
    _, rows = read_csv(path)
    specs = {name: model_spec(name, data_dir) for name in {r["model"] for r in rows}}
    return [Measurement("ft", r["gpu"], r["model"], f"B={r['batch']} P={r['input_len']} O={r['output_len']}",
                        float(r["latency_ms"]) / 1e3,
                        static_batch_steps(int(r["batch"]), int(r["input_len"]), int(r["output_len"])),
                        specs[r["model"]], engine=FT_ENGINE)
            for r in rows]


def load_paddle(path: Path, data_dir: Path = DATA_DIR) -> list[Measurement]:
    """PaddleNLP FastGeneration's published latencies of one generate() call: B prompts of one token, O steps of B
    sequences (`decode_steps`: the first runs the prompt's token, so the contexts grow from 1 to O; no context pass).
    Each build (CUDA 10.1, CUDA 11.2) is an engine of its own, fitted apart."""
    _, rows = read_csv(path)
    if any(r["input_len"] != "1" for r in rows):
        raise ValueError(f"{path}: only prompts of one token are described (input_len 1)")
    specs = {name: model_spec(name, data_dir) for name in {r["model"] for r in rows}}
    return [Measurement("paddle", r["gpu"], r["model"], f"B={r['batch']} O={r['output_len']}",
                        float(r["latency_ms"]) / 1e3, decode_steps(int(r["batch"]), 1, int(r["output_len"])),
                        specs[r["model"]], engine=f"{PADDLE_ENGINE} ({r['build']})")
            for r in rows]


def load_all(data_dir: Path = DATA_DIR) -> list[Measurement]:
    """Every measurement of the six sources; argonne rows longer than the model's context (vLLM rejects them at
    once) or that would preempt are left out. Rows on a kernel the model does not describe are kept, marked
    `outside`."""
    return (load_bsc(data_dir / BSC_FILE, data_dir) + load_argonne(data_dir / ARGONNE_FILE, data_dir)
            + load_qwen(data_dir / QWEN_FILE, data_dir) + load_own(data_dir / OWN_FILE, data_dir)
            + load_ft(data_dir / FT_FILE, data_dir) + load_paddle(data_dir / PADDLE_FILE, data_dir))


def described(measurements: Iterable[Measurement]) -> list[Measurement]:
    """The measurements whose kernels the model describes: those it is fitted to and judged on."""
    return [m for m in measurements if not m.outside]


# --- the model ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTable:
    """Every step of a list of measurements as arrays of bytes, FLOPs and sequences, for fast pricing."""

    row: np.ndarray  # index of the measurement each step group belongs to
    count: np.ndarray
    bytes: np.ndarray
    flops: np.ndarray
    seqs: np.ndarray
    measured: np.ndarray
    layers: np.ndarray  # the layers of each step group's model (`GpuConstants.host_scale`)

    @classmethod
    def of(cls, measurements: Sequence[Measurement]) -> StepTable:
        cols: list[list[float]] = [[], [], [], [], [], []]
        for i, m in enumerate(measurements):
            spec = m.spec
            for s in m.steps:
                size = spec.weight_read_bytes + spec.kv_bytes_per_token * (s.kv_read + s.new_tokens)
                work = (2 * spec.body_params * s.new_tokens + 2 * spec.lm_head_params * s.sampled
                        + 4 * spec.num_layers * spec.attention_width * s.attn_pairs)
                for col, value in zip(cols, (i, s.count, size, work, s.seqs, spec.num_layers)):
                    col.append(value)
        row, count, nbytes, flops, seqs, layers = (np.asarray(c, dtype=float) for c in cols)
        return cls(row.astype(int), count, nbytes, flops, seqs, np.array([m.measured_s for m in measurements]),
                   layers)

    def predict(self, c: GpuConstants) -> np.ndarray:
        """Predicted seconds of each measurement."""
        device = np.maximum(self.bytes / c.bandwidth_bps, self.flops / c.flop_rate)
        step = c.host_step_s * c.host_scale(self.layers) + c.host_per_seq_s * self.seqs + device
        return np.bincount(self.row, weights=self.count * step, minlength=len(self.measured))


FALLBACK_GPU = "H100-80GB"  # whose constants a GPU without data takes: the newest engine setup of the public data


def constants_for(gpu: str | GpuSpec, fitted: dict[str, GpuConstants]) -> tuple[GpuConstants, str]:
    """Constants for `gpu` (a name, or a GPU of its own) and where they came from: its own fit, or for a GPU without
    data FALLBACK_GPU's with the bandwidth scaled by the two datasheets' (and the rates capped at `gpu`'s)."""
    spec = gpu_spec(gpu) if isinstance(gpu, str) else gpu
    if spec.name in fitted:
        return fitted[spec.name], f"fitted on {spec.name}"
    c = fitted[FALLBACK_GPU]
    ratio = spec.bandwidth_bps / gpu_spec(FALLBACK_GPU).bandwidth_bps
    return (replace(c, bandwidth_bps=c.bandwidth_bps * ratio).capped(spec),
            f"{FALLBACK_GPU}'s, bandwidth x {ratio:.2f} (no {spec.name} data)")


def closed_loop_step_s(constants: GpuConstants, spec: ModelSpec, loop: ClosedLoop) -> float:
    """The mean step of a closed-loop point (`ClosedLoop.steps`), priced as the fit prices steps."""
    m = Measurement("prediction", "", spec.name, f"B={loop.clients:g}", loop.step_s, loop.steps(), spec)
    return float(predict(constants, [m])[0])


def predict(constants: GpuConstants, measurements: Sequence[Measurement]) -> np.ndarray:
    return StepTable.of(measurements).predict(constants)


def log_loss(table: StepTable, c: GpuConstants, delta: float = HUBER_DELTA) -> float:
    """Huber loss of the log ratio: squared within `delta` (5%), linear beyond, so that one odd window (a BSC
    batch just refilled after preemptions, docs/sim.md) does not drag a GPU's constants."""
    r = np.abs(np.log(table.predict(c)) - np.log(table.measured))
    return float(np.mean(np.where(r < delta, 0.5 * r * r, delta * (r - 0.5 * delta))))


# Where the search starts, as shares of the datasheet's bandwidth and FLOP/s and a 32-layer model's host time a step:
# the first is where one search started until 2026-12-02; the others start it where compute binds early (a low FLOP
# rate) with a short and a long host time, and at a high bandwidth. Fitted on OPT-1.3B's H200 points alone, a search
# from the first stopped, on one machine, in a basin 4% worse than the one the others find (0.96 ms a step, the FLOP
# rate at the card's peak), and on another machine in the better one: the starts make the end the same.
STARTS = ((0.6, 0.5, 1e-3), (0.6, 0.2, 0.3e-3), (0.6, 0.2, 3e-3), (0.9, 0.2, 1e-3))


def start_for(gpu: GpuSpec, host_layers: int = LAYER_REF, start: tuple[float, float, float] = STARTS[0]
              ) -> GpuConstants:
    """A point the search starts from: shares of the datasheet bandwidth and FLOP/s, a host time a step (STARTS),
    and 20 us a sequence; the host time's form (`GpuConstants.host_layers`) is the fit's."""
    bandwidth, flops, host_s = start
    return GpuConstants(bandwidth * gpu.bandwidth_bps, flops * gpu.peak_flops, host_s, 20e-6, host_layers)


FIT_TOL = 1e-6  # a restart that lowers the loss by less than this share of it ends the search


def fit(measurements: Sequence[Measurement], gpu: GpuSpec, host_layers: int = LAYER_REF, rounds: int = 40,
        iters: int = 250) -> GpuConstants:
    """Minimize `log_loss` over `gpu`'s constants (rates `capped` at its datasheet): from each of STARTS, Nelder-Mead
    restarted from its best point until a restart gains less than FIT_TOL of the loss (at most `rounds` times); the
    lowest end wins, the earlier start where two ends are within FIT_TOL. One start with a fixed few restarts stopped
    in a flat valley (the H200's OPT-1.3B alone, where host time and bandwidth trade freely) wherever the last one
    happened to be, and run to convergence it still ended in a worse basin on one machine than on another. Where
    every step has as many sequences as every other (batch-1 data), host_per_seq_s would only repeat host_step_s:
    it is 0, not fitted."""
    table = StepTable.of(measurements)
    free = 4 if np.ptp(table.seqs) > 0 else 3

    def loss(v: np.ndarray) -> float:
        return log_loss(table, GpuConstants.from_vector(v, host_layers).capped(gpu))

    def search(x: np.ndarray) -> tuple[float, np.ndarray]:
        best = loss(x)
        for _ in range(rounds):
            x = nelder_mead(loss, x, np.full(free, 0.3), iters)
            now = loss(x)
            gained, best = best - now, now
            if gained <= FIT_TOL * best:
                break
        return best, x

    ends = [search(start_for(gpu, host_layers, start).vector()[:free]) for start in STARTS]
    lowest = min(value for value, _ in ends)
    x = next(x for value, x in ends if value - lowest <= FIT_TOL * lowest)
    return GpuConstants.from_vector(x, host_layers).capped(gpu)


def fit_per_gpu(measurements: Sequence[Measurement], host_layers: int = LAYER_REF) -> dict[str, GpuConstants]:
    """One set of constants per GPU (per `Measurement.setup`: a GPU, and an engine other than vLLM apart), from
    its measurements that the model describes. A vLLM setup's key is its GPU's name (what `constants_for` looks
    up); another engine's never is one."""
    by_setup = group(described(measurements), lambda m: m.setup)
    return {k: fit(ms, gpu_spec(ms[0].gpu), host_layers) for k, ms in sorted(by_setup.items())}


def fitted_cost(gpu: GpuSpec, model: ModelSpec, data_dir: Path = DATA_DIR) -> tuple[StepCost, str]:
    """The simulator's StepCost for `model` on `gpu` from this fit (`constants_for`, fitted on all of that GPU's
    data the model describes; the host time by the model's layers), and where the constants came from."""
    measurements = [m for m in described(load_all(data_dir)) if not m.engine]
    name = gpu.name if any(m.gpu == gpu.name for m in measurements) else FALLBACK_GPU
    fitted = {name: fit([m for m in measurements if m.gpu == name], gpu_spec(name))}
    constants, origin = constants_for(gpu, fitted)
    return constants.step_cost(gpu, model), origin


def group(measurements: Iterable[Measurement], key: Callable[[Measurement], str]) -> dict[str, list[Measurement]]:
    out: dict[str, list[Measurement]] = {}
    for m in measurements:
        out.setdefault(key(m), []).append(m)
    return out


# --- leave one model out -----------------------------------------------------------------------------------------


def largest(errors: Sequence[float]) -> float:
    """The error furthest from zero, with its sign."""
    return float(errors[int(np.argmax(np.abs(errors)))])


@dataclass(frozen=True)
class HeldOut:
    """One model on one GPU, predicted by constants fitted without any of that model's measurements."""

    model: str
    gpu: str  # the setup: the GPU, and the engine where it is not vLLM
    params: int
    points: int
    errors: tuple[float, ...]  # predicted / measured - 1, per measurement the model describes
    outside: tuple[float, ...] = ()  # the same, per measurement on a kernel it does not (not judged)

    @property
    def mean_abs(self) -> float:
        return float(np.mean(np.abs(self.errors)))

    @property
    def worst(self) -> float:
        return largest(self.errors)

    @property
    def bias(self) -> float:
        return float(np.mean(self.errors))


def errors_of(constants: GpuConstants, measurements: Sequence[Measurement]) -> tuple[float, ...]:
    """predicted / measured - 1 for each measurement."""
    if not measurements:
        return ()
    got = predict(constants, measurements) / np.array([m.measured_s for m in measurements]) - 1
    return tuple(float(e) for e in got)


def leave_one_model_out(measurements: Sequence[Measurement], host_layers: int = LAYER_REF) -> list[HeldOut]:
    """For every model and GPU (setup: `Measurement.setup`): fit that setup's constants on the other models (the
    points the model describes), predict this one, both its described points and those outside."""
    out = []
    for setup, ms in sorted(group(measurements, lambda m: m.setup).items()):
        for model, held in sorted(group(ms, lambda m: m.model).items()):
            rest = described(m for m in ms if m.model != model)
            inside = described(held)
            if not rest or not inside:
                continue
            c = fit(rest, gpu_spec(ms[0].gpu), host_layers)
            outside = [m for m in held if m.outside]
            out.append(HeldOut(model, setup, held[0].spec.params, len(inside), errors_of(c, inside),
                               errors_of(c, outside)))
    return sorted(out, key=lambda h: (h.gpu, h.params))


def format_constants(constants: dict[str, GpuConstants]) -> str:
    lines = ["| GPU | bandwidth TB/s (of datasheet) | FLOP/s T (of peak) | host per step ms | host per seq us |",
             "|---|---:|---:|---:|---:|"]
    for name, c in constants.items():
        gpu = gpu_spec(name.split(",")[0])  # a setup: the GPU, and an engine other than vLLM
        lines.append(f"| {name} | {c.bandwidth_bps / 1e12:.2f} ({c.bandwidth_bps / gpu.bandwidth_bps:.0%}) | "
                     f"{c.flop_rate / 1e12:.0f} ({c.flop_rate / gpu.peak_flops:.0%}) | {c.host_step_s * 1e3:.2f} | "
                     f"{c.host_per_seq_s * 1e6:.1f} |")
    return "\n".join(lines)


def format_held_out(rows: Sequence[HeldOut], goal: float = 0.15) -> str:
    lines = ["| GPU | model | params | points | mean abs error | bias | worst point | within 15% |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for h in rows:
        lines.append(f"| {h.gpu} | {h.model} | {h.params / 1e9:.2f} B | {h.points} | {h.mean_abs:.1%} | "
                     f"{h.bias:+.1%} | {h.worst:+.1%} | {'yes' if h.mean_abs <= goal else 'no'} |")
    return "\n".join(lines)


def format_outside(rows: Sequence[HeldOut]) -> str:
    """The held-out error on the points outside the model, and over every point of the model and GPU."""
    if not any(h.outside for h in rows):
        return "none"
    lines = ["| GPU | model | points outside | their mean error | worst | mean abs error, every point |",
             "|---|---|---:|---:|---:|---:|"]
    for h in rows:
        if h.outside:
            every = np.abs(np.array(h.errors + h.outside))
            lines.append(f"| {h.gpu} | {h.model} | {len(h.outside)} | {np.mean(h.outside):+.1%} | "
                         f"{largest(h.outside):+.1%} | {np.mean(every):.1%} |")
    return "\n".join(lines)


def report(data_dir: Path = DATA_DIR, host_layers: int = LAYER_REF) -> str:
    """The fitted constants, the leave-one-model-out table, and the points outside the model (`host_layers` 0: one
    fixed host time a step for every model)."""
    measurements = load_all(data_dir)
    inside = described(measurements)
    models = sorted({m.model for m in measurements})
    gpus = sorted({m.gpu for m in measurements})
    setups = sorted({m.setup for m in measurements})
    held = leave_one_model_out(measurements, host_layers)
    per_step = f"host per step x layers / {host_layers}" if host_layers else "one host time a step for every model"
    return "\n\n".join([
        f"{len(measurements)} measurements, {len(models)} models ({', '.join(models)}), {len(gpus)} GPUs, "
        f"{len(setups)} sets of constants (a GPU, and an engine other than vLLM apart); "
        f"{len(measurements) - len(inside)} on a kernel the model does not describe (vLLM V0's PagedAttention V1 "
        "over several partitions: sliding-window models at num_seqs x num_heads > 512), not fitted, not judged",
        f"Constants fitted on all the data the model describes ({per_step}; mean abs error over the held-out table: "
        f"{np.mean([h.mean_abs for h in held]):.2%}):\n" + format_constants(fit_per_gpu(measurements, host_layers)),
        "Leave one model out (constants of that GPU fitted without the model):\n" + format_held_out(held),
        f"within 15% (mean abs error): {sum(h.mean_abs <= 0.15 for h in held)} of {len(held)}",
        "The points outside, predicted by the same held-out constants:\n" + format_outside(held)])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sim stepfit", description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA_DIR, help="folder of the step data (planner/data/stepdata)")
    parser.add_argument("--host-fixed", action="store_true",
                        help=f"one fixed host time a step for every model, where by default it is a {LAYER_REF}-layer "
                             "model's, scaled by each model's layers (the form before 2026-12-01: docs/sim.md)")
    args = parser.parse_args(argv)
    print(report(args.data, 0 if args.host_fixed else LAYER_REF))


if __name__ == "__main__":
    main()
