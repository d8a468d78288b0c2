"""The directory vLLM loads for `synthetic:NAME`: config.json, a tokenizer of exactly the real vocabulary size,
a chat template, and no weights (vLLM is started with `--load-format dummy`).

The tokenizer is byte-level BPE with no merges: the 256 byte tokens encode any text (one token per byte), the
special tokens sit at their real ids, and the remaining ids up to `vocab_size` are filler tokens, so every id a
randomly initialised model can sample decodes to something. It is made with `tokenizers` alone (no torch, no
transformers) in well under a second, once, into a cache directory whose name carries a hash of what went
into it; the write is atomic, so concurrent callers and interrupted runs never leave half a model behind.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from deploy.tinymodel import default_cache_dir, make_atomically
from synthetic.catalog import Entry, entry

GENERATOR_VERSION = 1  # bump when the files made here change, so cached directories are remade
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "generation_config.json")


def model_dir(name: str, cache: Path | None = None) -> Path:
    """Where `synthetic:NAME` is (or will be) made: named after its config and this generator's version."""
    item = entry(name)
    digest = hashlib.sha256(item.config_path.read_bytes() + repr((GENERATOR_VERSION, item)).encode())
    return (cache or default_cache_dir() / "models") / f"synthetic-{item.name}-{digest.hexdigest()[:10]}"


def is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in FILES)


def ensure_synthetic_model(name: str, cache: Path | None = None) -> Path:
    """Return the directory of `synthetic:NAME`, making it first if it is not there."""
    item = entry(name)
    target = model_dir(item.name, cache)
    return make_atomically(target, lambda scratch: write_model(item, scratch), is_complete,
                           f"the synthetic model {item.name}")


def write_model(item: Entry, path: Path) -> None:
    """Write the config, tokenizer and generation config of `item` into `path`."""
    config = item.config()
    config.setdefault("_name_or_path", item.hub_id)
    vocab = int(config["vocab_size"])
    max_len = int(config.get("max_position_embeddings", 2048))
    _dump(path / "config.json", config)
    make_tokenizer(item, vocab).save(str(path / "tokenizer.json"))
    specials = {"bos_token": item.bos, "eos_token": item.eos, "pad_token": item.pad}
    if item.unk:
        specials["unk_token"] = item.unk
    _dump(path / "special_tokens_map.json", specials)
    _dump(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": max_len,
        "chat_template": item.chat_template, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for i, t in sorted(item.special_tokens.items())}})
    _dump(path / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                            if k in config})


def token_table(item: Entry, vocab_size: int) -> dict[str, int]:
    """Token string -> id for every id below `vocab_size`: specials at their ids, then bytes, then fillers."""
    from tokenizers import pre_tokenizers

    if max(item.special_tokens) >= vocab_size:
        raise ValueError(f"{item.name}: special token id {max(item.special_tokens)} >= vocab size {vocab_size}")
    table = {text: i for i, text in item.special_tokens.items()}
    free = (i for i in range(vocab_size) if i not in item.special_tokens)
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        table[char] = next(free)
    for i in free:
        table[f"<synthetic_{i}>"] = i
    if len(table) != vocab_size:
        raise ValueError(f"{item.name}: made {len(table)} tokens for a vocabulary of {vocab_size}")
    return table


def make_tokenizer(item: Entry, vocab_size: int) -> Any:
    """A `tokenizers.Tokenizer` with exactly `vocab_size` ids (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE(vocab=token_table(item, vocab_size), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for _, t in sorted(item.special_tokens.items())])
    if item.add_bos:
        bos = item.special_tokens_by_text()[item.bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{item.bos} $A", pair=f"{item.bos} $A {item.bos} $B", special_tokens=[(item.bos, bos)])
    return tokenizer


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
