"""Facts about a model read from its local directory or the shipped configs (no network): weight bytes, KV bytes
per token, the architecture's shape, and the non-KV memory a replica needs at a batch cap.

All are optional: a model named by a hub id that is not on disk yields None, and the plan asks for flags.
`synthetic:NAME` models have a config.json but no weight files: their weights are counted from the config.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from synthetic import catalog
from synthetic.arch import ModelSpec, from_config

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "float8": 1}
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def _config(model: str) -> dict[str, Any] | None:
    if catalog.is_synthetic(model):
        try:
            return catalog.entry(model).config()
        except catalog.UnknownModel as exc:
            logger.warning("%s", exc)
            return None
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


def spec(model: str) -> ModelSpec | None:
    """The architecture's shape from its config.json (None: no config at hand, or a family not modelled)."""
    config = _config(model)
    if config is None:
        return None
    try:
        return from_config(config, model)
    except ValueError as exc:
        logger.info("no shape for %s: %s", model, exc)
        return None


def weight_files_bytes(model: str) -> int | None:
    """Bytes of weight files in a local model directory (None: not a local directory with weights)."""
    directory = Path(model)
    if catalog.is_synthetic(model) or not directory.is_dir():
        return None
    files = {f for pattern in _WEIGHT_PATTERNS for f in directory.glob(pattern)}
    return sum(f.stat().st_size for f in files) or None


def weights_bytes(model: str) -> int | None:
    """Bytes of weights: the weight files on disk, else parameters (from config.json) x 2 bytes (None: unknown)."""
    on_disk = weight_files_bytes(model)
    if on_disk is not None:
        return on_disk
    shape = spec(model)
    return shape.weight_bytes if shape is not None else None


def kv_bytes_per_token(model: str, dtype: str | None = None) -> float | None:
    """2 (K and V) x layers x KV heads x head dim x dtype bytes, from a local config.json (None: unknown).

    `dtype` is the KV cache's element type when known (vLLM's `--kv-cache-dtype` / `--dtype`); else the
    config's `torch_dtype`, and float16 when it names none.
    """
    config = _config(model)
    if config is None:
        return None
    hidden = config.get("hidden_size")
    layers = config.get("num_hidden_layers")
    heads = config.get("num_attention_heads")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads)):
        return None
    assert isinstance(hidden, int) and isinstance(layers, int) and isinstance(heads, int)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    name = str(dtype or config.get("torch_dtype") or config.get("dtype") or "float16").removeprefix("torch.")
    element = _DTYPE_BYTES.get(name, 2)
    return float(2 * layers * kv_heads * head_dim * element)


def non_kv_bytes(model: str, max_num_seqs: int) -> tuple[int, str] | None:
    """vLLM's non-KV memory at batch cap `max_num_seqs` (bytes, and how it was computed); None: unknown model.

    A fixed part (CUDA context, cuBLAS workspace, one forward pass's activations) plus the sampler's buffers,
    float32 rows of vocabulary size for each of `max_num_seqs` sequences: the simulator's memory model, fitted to
    the KV block counts vLLM 0.5.2 reported for OPT-1.3B on an H100 (docs/sim.md). A 150k-token vocabulary
    costs three times a 50k one per sequence.
    """
    from sim.memory import MemoryModel

    shape = spec(model)
    if shape is None:
        return None
    memory = MemoryModel()
    total = memory.overhead_bytes(shape, max_num_seqs)
    sampler = total - memory.fixed_bytes
    how = (f"computed: {memory.fixed_bytes / 2**20:.0f} MiB fixed + the sampler's {memory.sampler_vocab_rows:g} "
           f"float32 rows x vocab {shape.vocab_size:,} x B={max_num_seqs} = {sampler / 2**30:.2f} GiB "
           "(the simulator's memory model, fitted to vLLM 0.5.2 on an H100)")
    return int(total), how


_UNGATED = ("opt", "gpt2", "gpt_neox", "gptj", "bloom", "falcon", "phi")  # MLPs of two matrices, not three


def lora_slot_bytes(model: str, rank: int, dtype: str | None = None) -> tuple[int, str] | None:
    """Bytes one LoRA slot takes at `rank` (vLLM preallocates `max_loras` of them), from the model's config.json.

    vLLM gives every linear layer of every decoder layer an A (rank x in) and a B (out x rank) buffer per slot,
    whatever modules an adapter targets: q, k, v, o, and the MLP's up and down (and gate) projections. So one slot
    is rank x the sum of (in + out) over those layers x layers x the element size (the model's dtype).
    """
    config = _config(model)
    if config is None:
        return None
    hidden, layers, heads = (config.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads"))
    ffn = config.get("intermediate_size") or config.get("ffn_dim")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads, ffn)):
        return None
    assert isinstance(hidden, int) and isinstance(layers, int) and isinstance(heads, int) and isinstance(ffn, int)
    head_dim = config.get("head_dim") or hidden // heads
    q_dim, kv_dim = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim
    gated = str(config.get("model_type", "")).lower() not in _UNGATED
    attention = (hidden + q_dim) + 2 * (hidden + kv_dim) + (q_dim + hidden)
    mlp = (3 if gated else 2) * (hidden + ffn)
    name = str(dtype or config.get("torch_dtype") or config.get("dtype") or "float16").removeprefix("torch.")
    element = _DTYPE_BYTES.get(name, 2)
    total = rank * (attention + mlp) * layers * element
    how = (f"computed: rank {rank} x (attention {attention:,} + {'gated ' if gated else ''}MLP {mlp:,} in+out "
           f"features) x {layers} layers x {element} bytes")
    return total, how
