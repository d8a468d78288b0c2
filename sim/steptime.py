"""How long one engine step takes: a device part from a roofline, and a host part that does not use the GPU.

A vLLM step (V0 engine, as in the reference) runs one after another on the replica's CPU process and the GPU:

    host  : schedule the batch, build the input tensors, launch, sample, detokenize, stream the outputs
    device: the forward pass

The **device part** is a roofline: the pass streams every weight once plus the KV cache of every token it attends
to, and does 2 FLOPs per weight per token plus attention arithmetic, so

    device_s = max(bytes / (bandwidth x mem_efficiency), flops / (peak_flops x flop_efficiency))
    bytes    = weight_read_bytes + kv_bytes_per_token x (tokens attended to read + new tokens written)
    flops    = 2 x body_params x new_tokens + 2 x lm_head_params x sampled_seqs
               + 4 x layers x (heads x head_dim) x sum over new tokens of the context each attends to

Decode steps of small models are memory-bound: weights plus a KV read that grows with batch x context.
Prefill steps are compute-bound.

The **host part** is `host_step_s + host_per_seq_s x sequences in the step`: Python scheduling, input preparation
and output processing, which grow with the batch. It does not use the GPU. Within one replica host and device
alternate; replicas on one GPU overlap their host parts and share the device (see `device.py`), which is why
several replicas get more tokens/s out of one GPU than one instance at any batch cap.

`mem_efficiency`, `host_step_s` and `host_per_seq_s` are fitted to the reference (see `calibrate.py`);
`flop_efficiency` is assumed (prefill is a small share of the reference's work and does not pin it down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .gpus import GpuSpec
from .model import ModelSpec


@dataclass(frozen=True)
class StepCost:
    """The step-time model's constants. Defaults: fitted to OPT-1.3B on an H100 64 GB, vLLM 0.5.2 (docs/sim.md)."""

    host_step_s: float = 1.24e-3  # fitted
    host_per_seq_s: float = 40e-6  # fitted
    mem_efficiency: float = 0.578  # fitted: 1.16 TB/s of the H100 64 GB's assumed 2.0 TB/s
    flop_efficiency: float = 0.5  # assumed

    def __post_init__(self) -> None:
        for name in ("host_step_s", "host_per_seq_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("mem_efficiency", "flop_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")


class StepTime(Protocol):
    """What an engine asks of a step-time model (this roofline, or `sim.measured.MeasuredStepTime`)."""

    kv_bytes_per_token: float

    def host_s(self, seqs: int) -> float: ...

    def device_s(self, new_tokens: int, sampled: int, kv_read: float, attn_pairs: float,
                 decode_kv: float | None = None) -> float: ...


class StepTimeModel:
    """Step times for one model on one GPU; coefficients are precomputed because this runs once per step."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, cost: StepCost | None = None) -> None:
        self.model, self.gpu = model, gpu
        self.cost = cost = cost or StepCost()
        self.kv_bytes_per_token = float(model.kv_bytes_per_token)
        bw = gpu.bandwidth_bps * cost.mem_efficiency
        peak = gpu.peak_flops * cost.flop_efficiency
        self._weights_s = model.weight_read_bytes / bw
        self._kv_s = model.kv_bytes_per_token / bw  # per token of KV read or written
        self._tok_flop_s = 2 * model.body_params / peak
        self._sample_flop_s = 2 * model.lm_head_params / peak
        self._attn_flop_s = 4 * model.num_layers * model.attention_width / peak
        self._host_step = cost.host_step_s
        self._host_seq = cost.host_per_seq_s

    def device_s(self, new_tokens: int, sampled: int, kv_read: float, attn_pairs: float,
                 decode_kv: float | None = None) -> float:
        """Device seconds for a pass over `new_tokens` tokens, sampling `sampled` sequences.

        `kv_read`: tokens of KV cache read; `attn_pairs`: sum over new tokens of the context each attends to
        (for a decode step both are the sum of the sequences' lengths); `decode_kv`: the part of both that is the
        decoding sequences' (the roofline needs only the sums).
        """
        memory = self._weights_s + self._kv_s * (kv_read + new_tokens)
        compute = self._tok_flop_s * new_tokens + self._sample_flop_s * sampled + self._attn_flop_s * attn_pairs
        return memory if memory > compute else compute

    def host_s(self, seqs: int) -> float:
        """Host seconds of a step over `seqs` sequences."""
        return self._host_step + self._host_seq * seqs

    def decode_s(self, batch: int, mean_len: float) -> float:
        """Device seconds of a decode step of `batch` sequences of `mean_len` tokens (for planning and tests)."""
        total = batch * mean_len
        return self.device_s(batch, batch, total, total)
