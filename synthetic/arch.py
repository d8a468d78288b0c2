"""A model's shape read from its Hugging Face `config.json`: what memory and arithmetic depend on.

Parameter count (bytes of weights, FLOPs per token), KV bytes per token (2 (K and V) x layers x KV heads x head
dim x 2 bytes: grouped-query attention and an explicit `head_dim` change it), the vocabulary (the logits
matrix and the sampler's buffers scale with it) and whether the input embedding and the LM head are one tied
matrix (counted once). Families: OPT, GPT-2, and the Llama family (llama, mistral, qwen2, qwen3, gemma 1-3,
phi3, granite: gated MLP, RMSNorm, optional GQA). Pure: no torch, no transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from synthetic import catalog

_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite"}
# Families whose config class ties the embedding and the LM head unless config.json says otherwise.
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3_text"}
_QK_NORM = {"qwen3", "gemma3_text"}  # a per-head RMSNorm on queries and keys
_FOUR_NORMS = {"gemma2", "gemma3_text"}  # pre- and post-norms around attention and MLP
_QKV_BIAS = {"qwen2"}


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
    other_params: int  # embeddings (when not tied), position tables, norms, biases: memory, (almost) no arithmetic
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    sliding_window: int | None = None  # Gemma 3: 5 of every 6 layers attend to this many tokens only

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
        """K and V for every layer: 2 x dtype x kv_heads x head_dim x layers.

        Sliding-window layers are counted in full: an upper bound for requests longer than the window.
        """
        return 2 * self.dtype_bytes * self.num_kv_heads * self.head_dim * self.num_layers

    @property
    def attention_width(self) -> int:
        """num_heads x head_dim: the width of Q K^T and A V per layer."""
        return self.num_heads * self.head_dim


def _opt(name: str, cfg: dict[str, Any]) -> ModelSpec:
    h, layers, ffn = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["ffn_dim"]
    heads, vocab = cfg["num_attention_heads"], cfg["vocab_size"]
    proj = cfg.get("word_embed_proj_dim", h)
    max_pos = cfg.get("max_position_embeddings", 2048)
    body = layers * (4 * h * h + 2 * h * ffn) + (2 * h * proj if proj != h else 0)
    other = (max_pos + 2) * h + layers * (4 * h + ffn + h + 4 * h) + 2 * h
    # The input embedding and the LM head are one tied matrix: counted once, under lm_head.
    return ModelSpec(name, layers, h, heads, heads, h // heads, vocab, max_pos, body, vocab * proj, other,
                     tied_embeddings=True)


def _gpt2(name: str, cfg: dict[str, Any]) -> ModelSpec:
    h, layers, heads, vocab = cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["vocab_size"]
    ffn = cfg.get("n_inner") or 4 * h
    max_pos = cfg.get("n_positions", 1024)
    body = layers * (4 * h * h + 2 * h * ffn)
    other = max_pos * h + layers * (4 * h + ffn + h + 4 * h) + 2 * h
    return ModelSpec(name, layers, h, heads, heads, h // heads, vocab, max_pos, body, vocab * h, other,
                     tied_embeddings=True)


def _llama(name: str, kind: str, cfg: dict[str, Any]) -> ModelSpec:
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    body = layers * (attn + 3 * h * inter)
    tied = bool(cfg.get("tie_word_embeddings", kind in _TIED_BY_DEFAULT))
    norms = (4 if kind in _FOUR_NORMS else 2) * h + (2 * head_dim if kind in _QK_NORM else 0)
    bias = (heads + 2 * kv_heads) * head_dim if kind in _QKV_BIAS else 0
    other = layers * (norms + bias) + h + (0 if tied else vocab * h)
    max_len = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window") if kind == "gemma3_text" else None
    return ModelSpec(name, layers, h, heads, kv_heads, head_dim, vocab, max_len, body, vocab * h, other,
                     tied_embeddings=tied, sliding_window=window)


def from_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """A ModelSpec from a parsed config.json."""
    kind = str(cfg.get("model_type", "")).lower()
    try:
        if kind == "opt":
            return _opt(name, cfg)
        if kind == "gpt2":
            return _gpt2(name, cfg)
        if kind in _LLAMA_LIKE:
            return _llama(name, kind, cfg)
    except KeyError as exc:
        raise ValueError(f"config.json for {name!r} lacks {exc.args[0]!r}") from None
    # vLLM's dtype "auto" serves float32 and float16 checkpoints in float16 and bfloat16 ones in bfloat16: two
    # bytes per weight and per KV element whatever `torch_dtype` says (quantized checkpoints are not modelled).
    raise ValueError(f"model_type {kind!r} is not supported (opt, gpt2, {', '.join(sorted(_LLAMA_LIKE))})")


def config_path(source: str) -> Path:
    """The config.json for `source`: `synthetic:NAME`, a shipped NAME, a file, or a directory holding one."""
    if catalog.is_synthetic(source):
        return catalog.entry(source).config_path
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    shipped = source.lower().split("/")[-1]
    if shipped in catalog.ENTRIES:
        return catalog.ENTRIES[shipped].config_path
    raise ValueError(f"model {source!r}: no such config.json or directory holding one (shipped: "
                     f"{', '.join(catalog.names())}, also as synthetic:NAME)")


def read_config(source: str) -> dict[str, Any]:
    """The parsed config.json for `source` (see `config_path`)."""
    path = config_path(source)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    return cfg


def load_spec(source: str) -> ModelSpec:
    """The shape of `source` (see `config_path`); named by `_name_or_path`, the catalog's hub id, or the folder."""
    cfg = read_config(source)
    path = config_path(source)
    shipped = catalog.ENTRIES.get(path.parent.name)
    name = cfg.get("_name_or_path") or (shipped.hub_id if shipped and shipped.config_path == path else None)
    return from_config(cfg, str(name or path.parent.name))
