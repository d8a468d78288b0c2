"""How many 16-token KV blocks a replica gets from its share of GPU memory, as vLLM sizes them.

vLLM takes `gpu_memory_utilization x GPU memory`, subtracts the weights and the peak non-KV memory of a profiling
forward pass, and cuts the rest into blocks of `block_size` tokens. The non-KV part is modelled as a fixed part
(CUDA context, cuBLAS workspace, activations of one `max_num_batched_tokens` pass) plus the sampler's buffers,
which grow with `max_num_seqs`: a few float32 rows of vocabulary size per sequence (logits, probabilities,
log-probabilities, sort buffers). Both constants are fitted to the block counts vLLM 0.5.2 reported for
OPT-1.3B on an H100 64 GB at max_num_seqs 96 and 768 (see docs/sim.md); other rows of the reference check them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gpus import GpuSpec
from .model import ModelSpec

MIB = 1024**2
BLOCK_SIZE = 16


@dataclass(frozen=True)
class MemoryModel:
    """The non-KV memory of one vLLM instance: a fixed part and the sampler's per-sequence buffers."""

    fixed_bytes: float = 730 * MIB  # fitted: 730.7 MiB
    sampler_vocab_rows: float = 9.08  # fitted: float32 rows of vocab size per sequence of max_num_seqs

    def overhead_bytes(self, model: ModelSpec, max_num_seqs: int) -> float:
        return self.fixed_bytes + self.sampler_vocab_rows * 4 * model.vocab_size * max_num_seqs


def block_bytes(model: ModelSpec, block_size: int = BLOCK_SIZE) -> int:
    return block_size * model.kv_bytes_per_token


def num_gpu_blocks(model: ModelSpec, gpu: GpuSpec, utilization: float, max_num_seqs: int,
                   memory: MemoryModel | None = None, block_size: int = BLOCK_SIZE) -> int:
    """KV blocks for one instance given its memory fraction; ValueError when the weights do not fit."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    memory = memory or MemoryModel()
    budget = utilization * gpu.memory_bytes
    free = budget - model.weight_bytes - memory.overhead_bytes(model, max_num_seqs)
    blocks = int(free // block_bytes(model, block_size))
    if blocks <= 0:
        raise ValueError(
            f"{model.name} does not fit in {utilization:g} x {gpu.name} ({budget / 2**30:.2f} GiB): weights "
            f"{model.weight_bytes / 2**30:.2f} GiB + overhead {memory.overhead_bytes(model, max_num_seqs) / 2**30:.2f}"
            " GiB leave no room for a KV cache")
    return blocks
