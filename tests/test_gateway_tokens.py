"""Prompt token counting with the model's tokenizer when there is one, an estimate otherwise."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from gateway.parsing import parse
from gateway.tokens import TokenCounter, estimate


def make_tokenizer(directory: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return tok


def test_named_tokenizer_is_used(tmp_path: Path) -> None:
    """A model the config names a tokenizer for (a directory or the file) is counted with it."""
    tok = make_tokenizer(tmp_path / "model")
    counter = TokenCounter.from_sources({"m": str(tmp_path / "model"), "f": str(tmp_path / "model" / "tokenizer.json")})
    text = "the quick brown fox"
    assert counter.count("m", text) == counter.count("f", text) == len(tok.encode(text).ids) != estimate(text)


def test_a_model_named_by_its_path_is_not_loaded(tmp_path: Path) -> None:
    """A model string that happens to be a tokenizer's directory is estimated, not loaded: only names are looked up."""
    make_tokenizer(tmp_path / "model")
    counter = TokenCounter()
    assert counter.count(str(tmp_path / "model"), "x" * 40) == 10
    assert len(counter) == 0


def test_estimate_without_a_tokenizer() -> None:
    """Without a tokenizer, about four bytes make a token."""
    assert TokenCounter().count("some-hub/model", "x" * 40) == 10 == estimate("x" * 40)
    assert estimate("abc") == 1


def test_request_cost_from_each_prompt_form() -> None:
    """Strings, string lists, token ids, chat messages and n all shape the cost."""
    counter = TokenCounter()
    assert parse(b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}', "completions", counter, 99).prompt_tokens == 3
    info = parse(b'{"model": "m", "prompt": ["abcd", "abcdefgh"], "n": 2, "max_tokens": 5}', "completions", counter, 9)
    assert (info.prompt_tokens, info.max_tokens) == (3, 10)
    chat = parse(b'{"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}, '
                 b'{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}', "chat", counter, 64)
    assert (chat.prompt_tokens, chat.max_tokens) == (2 + 1 + 8, 64)
