"""A tiny BERT embedding model made locally (random weights, the tiny model's tokenizer): the offline embedder.

Like `deploy/tinymodel.py`, it exists so that a machine with no network can serve a real embedding model with
real vLLM (`--runner pooling`): its vectors mean nothing, but the path (planner, deploy, gateway, vLLM's pooling
runner, the `openai` client's `embeddings.create`) is the real one. Made once, atomically, into the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from deploy.tinymodel import default_cache_dir, ensure_tiny_model, is_complete, make_atomically

TINY_EMBED_NAME = "tiny-embed"
# Head dim 64 (256 / 4), as the tiny OPT model: the size vLLM's CPU kernels accept.
HIDDEN, LAYERS, HEADS, FFN, MAX_POSITIONS = 256, 2, 4, 1024, 512


def default_embed_dir() -> Path:
    return default_cache_dir() / "models" / TINY_EMBED_NAME


def ensure_tiny_embedding_model(path: str | Path | None = None, seed: int = 0) -> Path:
    """Return a directory holding the tiny embedding model, making it first if it is not there."""
    target = Path(path) if path is not None else default_embed_dir()
    return make_atomically(target, lambda scratch: _make(scratch, seed), is_complete, "the tiny embedding model")


def _make(path: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    # The tiny OPT model's tokenizer (trained here): one tokenizer to make, and its counts are the gateway's.
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS,
                        type_vocab_size=2, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=False)
    model.save_pretrained(path)
    tokenizer.model_max_length = MAX_POSITIONS
    tokenizer.save_pretrained(path)
    # Mean pooling, normalized: what sentence-transformers BERT embedders declare, read by vLLM's pooler.
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": HIDDEN, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    (path / "2_Normalize").mkdir()
