"""What the simulator needs to know about a model, read from its Hugging Face `config.json`.

Only the shape matters: parameter count (hence bytes of weights and FLOPs per token) and the KV cache's bytes
per token. For OPT, KV bytes/token = 2 (K and V) x 2 (fp16) x hidden_size x num_layers. Supported families:
OPT, GPT-2, and the Llama family (llama, mistral, qwen2, ...: grouped-query attention, gated MLP).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).parent / "configs"
_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "granite"}


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape, as far as memory traffic and arithmetic go."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    body_params: int  # weights of the transformer layers' matrices: 2 FLOPs each per token
    lm_head_params: int  # the logits matrix: 2 FLOPs each per *sampled* token
    other_params: int  # embeddings, position tables, norms, biases: memory, but (almost) no arithmetic
    dtype_bytes: int = 2

    @property
    def params(self) -> int:
        return self.body_params + self.lm_head_params + self.other_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights in GPU memory."""
        return self.params * self.dtype_bytes

    @property
    def weight_read_bytes(self) -> int:
        """Bytes of weights every forward pass streams from memory (the layers and the logits matrix)."""
        return (self.body_params + self.lm_head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 x dtype x kv_heads x head_dim x layers."""
        return 2 * self.dtype_bytes * self.num_kv_heads * self.head_dim * self.num_layers

    @property
    def attention_width(self) -> int:
        """num_heads x head_dim: the width of Q K^T and A V per layer."""
        return self.num_heads * self.head_dim


def _get(cfg: dict[str, Any], *names: str) -> Any:
    for name in names:
        if name in cfg:
            return cfg[name]
    raise ValueError(f"config.json lacks {' / '.join(names)}")


def _opt(name: str, cfg: dict[str, Any]) -> ModelSpec:
    h, layers, ffn = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["ffn_dim"]
    heads, vocab = cfg["num_attention_heads"], cfg["vocab_size"]
    proj = cfg.get("word_embed_proj_dim", h)
    max_pos = cfg.get("max_position_embeddings", 2048)
    body = layers * (4 * h * h + 2 * h * ffn) + (2 * h * proj if proj != h else 0)
    other = (max_pos + 2) * h + layers * (4 * h + ffn + h + 4 * h) + 2 * h
    # The input embedding and the LM head are one tied matrix: counted once, under lm_head.
    return ModelSpec(name, layers, h, heads, heads, h // heads, vocab, max_pos, body, vocab * proj, other)


def _gpt2(name: str, cfg: dict[str, Any]) -> ModelSpec:
    h, layers, heads, vocab = cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["vocab_size"]
    ffn = cfg.get("n_inner") or 4 * h
    max_pos = cfg.get("n_positions", 1024)
    body = layers * (4 * h * h + 2 * h * ffn)
    other = max_pos * h + layers * (4 * h + ffn + h + 4 * h) + 2 * h
    return ModelSpec(name, layers, h, heads, heads, h // heads, vocab, max_pos, body, vocab * h, other)


def _llama(name: str, cfg: dict[str, Any]) -> ModelSpec:
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    body = layers * (attn + 3 * h * inter)
    tied = cfg.get("tie_word_embeddings", False)
    other = layers * 2 * h + h + (0 if tied else vocab * h)
    max_len = cfg.get("max_position_embeddings", 4096)
    return ModelSpec(name, layers, h, heads, kv_heads, head_dim, vocab, max_len, body, vocab * h, other)


def from_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """A ModelSpec from a parsed config.json."""
    kind = str(cfg.get("model_type", "")).lower()
    try:
        if kind == "opt":
            spec = _opt(name, cfg)
        elif kind == "gpt2":
            spec = _gpt2(name, cfg)
        elif kind in _LLAMA_LIKE:
            spec = _llama(name, cfg)
        else:
            raise ValueError(f"model_type {kind!r} is not supported (opt, gpt2, {', '.join(sorted(_LLAMA_LIKE))})")
    except KeyError as exc:
        raise ValueError(f"config.json for {name!r} lacks {exc.args[0]!r}") from None
    # vLLM's dtype "auto" serves float32 and float16 checkpoints in float16 and bfloat16 ones in bfloat16: two
    # bytes per weight and per KV element whatever `torch_dtype` says (quantized checkpoints are not modelled).
    return spec


def resolve(source: str) -> Path:
    """The config.json for `source`: a file, a directory holding one, or a shipped name (opt-125m, opt-1.3b, ...)."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    shipped = CONFIG_DIR / source.lower().split("/")[-1] / "config.json"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir()))
    raise ValueError(f"model {source!r}: no such config.json or directory holding one (shipped: {names})")


def load_model(source: str) -> ModelSpec:
    """Read a model's config.json (see `resolve`); the model's name is its `_name_or_path` or the directory's."""
    path = resolve(source)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    name = cfg.get("_name_or_path") or path.parent.name
    return from_config(cfg, str(name))
