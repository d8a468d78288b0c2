"""The tiny offline embedding model: a BERT made once, reused, served by vLLM's pooling runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.models import resolve
from deploy.tinyembed import ensure_tiny_embedding_model
from deploy.tinymodel import is_complete


def test_tiny_embedding_model_is_made_once_and_complete(tmp_path: Path) -> None:
    """Weights, a BERT config with head dim 64, the tiny model's tokenizer, and mean pooling declared."""
    path = ensure_tiny_embedding_model(tmp_path / "embed")
    assert is_complete(path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["BertModel"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    modules = json.loads((path / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((path / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_embedding_model(tmp_path / "embed") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_tiny_embed_resolves_to_the_pooling_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tiny-embed` is served as itself, offline, with --runner pooling and the tiny model's CPU flags."""
    monkeypatch.setenv("SMALLSERVE_CACHE", str(tmp_path))
    model = resolve("tiny-embed")
    assert model.served_name == "tiny-embed" and model.offline
    assert Path(model.source) == tmp_path / "models" / "tiny-embed"
    assert ("--runner", "pooling") in model.vllm_flags(gpu=False)
