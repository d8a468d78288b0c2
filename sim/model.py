"""What the simulator needs to know about a model: its shape, read from its Hugging Face `config.json`.

The shape and the arithmetic live in `synthetic.arch` (the planner uses them too); the shipped architectures
(opt-125m, opt-1.3b, opt-2.7b, qwen3-0.6b, llama-3.2-1b, ...) live once, in `synthetic/configs/`. For OPT, KV
bytes/token = 2 (K and V) x 2 (fp16) x hidden_size x num_layers; with grouped-query attention it is
2 x 2 x num_key_value_heads x head_dim x num_layers.
"""

from __future__ import annotations

from pathlib import Path

from synthetic.arch import ModelSpec, config_path, from_config, load_spec

__all__ = ["ModelSpec", "from_config", "load_model", "resolve"]


def resolve(source: str) -> Path:
    """The config.json for `source`: a file, a directory holding one, a shipped name, or `synthetic:NAME`."""
    return config_path(source)


def load_model(source: str) -> ModelSpec:
    """Read a model's config.json (see `resolve`); the model's name is its `_name_or_path` or the hub id."""
    return load_spec(source)
