"""Facts about a model read from its local directory (no network): weight bytes, KV bytes per token.

Both are optional: a model named by a hub id that is not on disk yields None, and the plan asks for flags.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "float8": 1}
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def _config(model: str) -> dict[str, Any] | None:
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


def weights_bytes(model: str) -> int | None:
    """Bytes of weight files in a local model directory (None: not a local directory with weights)."""
    directory = Path(model)
    if not directory.is_dir():
        return None
    files = {f for pattern in _WEIGHT_PATTERNS for f in directory.glob(pattern)}
    return sum(f.stat().st_size for f in files) or None


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
