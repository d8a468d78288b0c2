"""Prompt token counting: a tokenizer the operator named, or one a replica's model directory holds; else an estimate.

Tokenizers are loaded at start (`tokenizers:` in the config; `deploy up` writes one entry per local model directory
of its plan) and when a health probe finds a replica serving a model whose `/v1/models` card has a `root` that is a
local directory with a `tokenizer.json` (vLLM puts the path it loaded the model from there). Never because of what
a request names: a client's `model` string is only looked up here, so it can neither make the gateway open a file
nor grow this table.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

# Imported at start, not on a request's path: an import needs file descriptors, which may be exhausted then.
from tokenizers import Tokenizer as HFTokenizer

from .config import ConfigError

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4  # the usual estimate for English text with BPE tokenizers
CHAT_TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds
# Bodies larger than this are estimated, not tokenized: tokenizing costs about 0.5 us of event-loop time per byte
# (measured with OPT, Qwen3, SmolLM2 and Gemma 3 tokenizers), so a 4 MiB prompt would stall every client for 2 s.
EXACT_MAX_BYTES = 16 * 1024
MAX_DISCOVERED = 64  # tokenizers found through replicas' model cards (a replica may list any number of models)
MAX_TOKENIZER_FILE = 256 * 1024 * 1024  # a found tokenizer.json larger than this is not read

Count = Callable[[str], int]


class Tokenizer(Protocol):
    def encode(self, text: str) -> object: ...


def estimate(text: str) -> int:
    """About 4 bytes per token, at least one token for non-empty text."""
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def load(source: str | Path, max_bytes: int | None = None) -> HFTokenizer | None:
    """The tokenizer in `source` (a tokenizer.json, or a directory holding one), or None (logged) if there is none."""
    path = Path(source)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        info = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or (max_bytes is not None and info.st_size > max_bytes):
        logger.warning("not loading %s: not a regular file of at most %s bytes", path, max_bytes)
        return None
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        logger.warning("cannot load tokenizer %s (%s); estimating token counts", path, exc)
        return None


def check_sources(sources: Mapping[str, str]) -> None:
    """ConfigError naming the first tokenizer path that does not exist."""
    for model, source in sources.items():
        if not os.path.exists(source):
            raise ConfigError(f"tokenizers: {model!r} names {source!r}, which does not exist")


def _exact(tokenizer: HFTokenizer) -> Count:
    encode = tokenizer.encode
    return lambda text: len(encode(text).ids)


class TokenCounter:
    """Counts prompt tokens per model with the tokenizers loaded so far (see the module docstring for which)."""

    def __init__(self, tokenizers: Mapping[str, HFTokenizer] | None = None) -> None:
        self._exact: dict[str, Count] = {}
        self._tried: set[str] = set()  # models whose card root was tried (bounded by MAX_DISCOVERED)
        self._full_logged = False
        for model, tokenizer in (tokenizers or {}).items():
            self.add(model, tokenizer)

    @classmethod
    def from_sources(cls, sources: Mapping[str, str]) -> TokenCounter:
        """Load the tokenizers the config names; a path that does not exist is a configuration error."""
        check_sources(sources)
        counter = cls()
        for model, source in sources.items():
            tokenizer = load(source)
            if tokenizer is not None:
                counter.add(model, tokenizer)
        return counter

    def add(self, model: str, tokenizer: HFTokenizer) -> None:
        self._exact[model] = _exact(tokenizer)
        logger.info("counting %s prompt tokens with its tokenizer", model)

    def knows(self, model: str) -> bool:
        """Whether `model` is counted with its own tokenizer."""
        return model in self._exact

    def __len__(self) -> int:
        return len(self._exact)

    def counter(self, model: str, body_size: int) -> Count:
        """How to count a request's text: the model's tokenizer, unless there is none or the body is too large."""
        exact = self._exact.get(model)
        return estimate if exact is None or body_size > EXACT_MAX_BYTES else exact

    def count(self, model: str, text: str) -> int:
        return self.counter(model, len(text))(text)

    async def discover(self, cards: Mapping[str, Mapping[str, object]]) -> None:
        """Load the tokenizers of models whose card `root` is a local directory (in a thread: files can be large)."""
        for model, card in cards.items():
            root = card.get("root")
            if model in self._exact or model in self._tried or not isinstance(root, str) or not os.path.isabs(root):
                continue
            if len(self._tried) >= MAX_DISCOVERED:
                if not self._full_logged:
                    self._full_logged = True
                    logger.warning("not looking for more tokenizers (%s and later): %d models tried already", model,
                                   MAX_DISCOVERED)
                return
            self._tried.add(model)
            tokenizer = await asyncio.to_thread(load, root, MAX_TOKENIZER_FILE)
            if tokenizer is not None:
                self.add(model, tokenizer)
