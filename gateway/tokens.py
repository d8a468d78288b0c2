"""Prompt token counting: the model's own tokenizer when one can be loaded, an estimate otherwise."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4  # the usual estimate for English text with BPE tokenizers
CHAT_TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds


class Tokenizer(Protocol):
    def encode(self, text: str) -> object: ...


def estimate(text: str) -> int:
    """About 4 bytes per token, at least one token for non-empty text."""
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def _load(source: str) -> Tokenizer | None:
    from tokenizers import Tokenizer as HFTokenizer  # loaded lazily: only models with a local tokenizer need it

    path = Path(source)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return HFTokenizer.from_file(str(path))
    except (OSError, ValueError, RuntimeError) as exc:  # tokenizers raises these for unreadable files
        logger.warning("cannot load tokenizer %s (%s); estimating token counts", path, exc)
        return None


class TokenCounter:
    """Counts prompt tokens per model; each model's tokenizer is loaded once (or found missing once)."""

    def __init__(self, sources: dict[str, str] | None = None) -> None:
        self._sources = dict(sources or {})
        self._tokenizers: dict[str, Tokenizer | None] = {}

    def tokenizer(self, model: str) -> Tokenizer | None:
        if model not in self._tokenizers:
            # A model served from a local directory names its own tokenizer.
            self._tokenizers[model] = _load(self._sources.get(model, model))
            if self._tokenizers[model] is not None:
                logger.info("counting %s prompt tokens with its tokenizer", model)
        return self._tokenizers[model]

    def count(self, model: str, text: str) -> int:
        tok = self._tokenizers[model] if model in self._tokenizers else self.tokenizer(model)
        if tok is None:
            return -(-len(text.encode()) // BYTES_PER_TOKEN)  # estimate(), inlined: this runs for every request
        return len(tok.encode(text).ids)  # type: ignore[attr-defined]
