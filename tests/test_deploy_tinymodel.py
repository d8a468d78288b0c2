"""The tiny offline model: made once, reused, loadable, with what vLLM's chat endpoint needs."""

from __future__ import annotations

import json
from pathlib import Path

from deploy.tinymodel import ensure_tiny_model, is_complete


def test_tiny_model_is_made_once_and_complete(tmp_path: Path) -> None:
    """The model directory has weights, an OPT config vLLM's CPU kernels accept, and a chat-ready tokenizer."""
    from transformers import AutoTokenizer

    path = ensure_tiny_model(tmp_path / "tiny")
    assert is_complete(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "opt" and config["hidden_size"] // config["num_attention_heads"] == 64
    assert 900 <= config["vocab_size"] <= 1100 and config["max_position_embeddings"] == 2048
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.bos_token and tokenizer.eos_token and tokenizer.pad_token
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert "Hi" in prompt and prompt.endswith("assistant:")
    assert tokenizer.decode(tokenizer.encode("hello world 123")).strip() == "hello world 123"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no scratch directory left behind
