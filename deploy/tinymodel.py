"""A tiny OPT-architecture model made locally (random weights, a tokenizer trained here): the offline default.

It serves nonsense, fast: it exists so that a machine with no network can run real vLLM replicas. It is made
once into a cache directory and reused (`ensure_tiny_model()`); the write is atomic, so concurrent callers and
interrupted runs never leave a half-made model behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny-opt"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# The architecture vLLM's CPU kernels accept: head dim 64 (256 / 4); 16 is rejected.
HIDDEN, LAYERS, HEADS, FFN, MAX_POSITIONS = 256, 2, 4, 1024, 2048
VOCAB_SIZE = 1000
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Several replicas of a small language model share one GPU behind a gateway.",
    "A gateway routes each request to the replica with the fewest outstanding tokens.",
    "Hello! How are you today? I am fine, thank you. What is the weather like?",
    "Once upon a time there was a tiny model that could only say nonsense, very quickly.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ' \" ( ) [ ] { } - _ / \\",
    "user: tell me a story\nassistant: there once was a server that never slept.\n",
]


def default_cache_dir() -> Path:
    """Where smallserve keeps generated things: $SMALLSERVE_CACHE, else ~/.cache/smallserve."""
    return Path(os.environ.get("SMALLSERVE_CACHE") or Path.home() / ".cache" / "smallserve")


def default_model_dir() -> Path:
    return default_cache_dir() / "models" / TINY_MODEL_NAME


def is_complete(path: Path) -> bool:
    """Whether `path` holds a whole tiny model (weights, config and tokenizer)."""
    return all((path / name).is_file() for name in ("config.json", "tokenizer.json", "tokenizer_config.json")) and \
        any(path.glob("*.safetensors"))


def ensure_tiny_model(path: str | Path | None = None, seed: int = 0) -> Path:
    """Return a directory holding the tiny model, making it first if it is not there."""
    target = Path(path) if path is not None else default_model_dir()
    return make_atomically(target, lambda scratch: _make(scratch, seed), is_complete, "the tiny offline model")


def make_atomically(target: Path, make: Callable[[Path], None], complete: Callable[[Path], bool], what: str) -> Path:
    """`target`, made by `make` in a scratch directory beside it and moved into place, unless already `complete`.

    Concurrent callers and interrupted runs never leave a half-made directory at `target`.
    """
    if complete(target):
        return target
    logger.info("making %s in %s", what, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make(scratch)
        if complete(target):  # someone else finished first
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(scratch, target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    return target


def _make(path: Path, seed: int) -> None:
    # Heavy imports stay here: `deploy status` must not pay for torch.
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    numbers = [" ".join(str(n) for n in range(k, k + 40)) for k in range(0, 2000, 40)]
    bpe.train_from_iterator(_CORPUS * 4 + numbers, vocab_size=VOCAB_SIZE, min_frequency=1,
                            special_tokens=SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=MAX_POSITIONS)
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab = len(tokenizer)
    config = OPTConfig(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       ffn_dim=FFN, max_position_embeddings=MAX_POSITIONS, word_embed_proj_dim=HIDDEN,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = OPTForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
