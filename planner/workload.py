"""The requests a profile (or a validation run) sends: fixed lengths, a ShareGPT file, or a JSONL of prompts.

Fixed lengths are the papers' default (512 input tokens, 256 output, `ignore_eos`). A prompt of N tokens is
built with the model's tokenizer when one is at hand (`tokenizer.json` in the model directory, or
`--tokenizer`), else approximated with N short words; either way the token counts the server reports are what
the profile records. Every prompt starts differently, so vLLM's prefix cache cannot serve it for free.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loadtest.workloads import EstimatedTokens, TokenizerTokens, parse_sharegpt
from planner.errors import PlannerError
from planner.points import Workload

logger = logging.getLogger(__name__)

_WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "on", "for", "as", "at", "by", "we", "be", "or", "an",
          "so", "if", "no", "up", "do", "go", "me", "my", "he", "us", "am", "hi", "ok")


@dataclass(frozen=True)
class RequestSpec:
    """One completion request: the prompt and how many tokens to generate."""

    prompt: str
    max_tokens: int
    ignore_eos: bool = True


class PromptBuilder(Protocol):
    """Makes a prompt of about `n_tokens` tokens, different for each `index`."""

    exact: bool

    def build(self, n_tokens: int, index: int) -> str: ...

    def count(self, text: str) -> int | None: ...


class ApproximatePrompts:
    """Short common words, one per token: close for BPE tokenizers, exact for none (counts come back from vLLM)."""

    exact = False

    def build(self, n_tokens: int, index: int) -> str:
        rng = random.Random(index)
        head = f"{index}"
        return " ".join([head] + [rng.choice(_WORDS) for _ in range(max(0, n_tokens - 1))])

    def count(self, text: str) -> int | None:
        return None


class TokenizerPrompts:
    """Random vocabulary tokens decoded to text, trimmed until the text encodes to exactly `n_tokens`."""

    exact = True

    def __init__(self, tokenizer_file: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        special = set(self.tokenizer.get_added_tokens_decoder())
        ids = [i for i in range(self.tokenizer.get_vocab_size()) if i not in special]
        # Only tokens that survive decode -> encode as themselves (not partial UTF-8 bytes, not tokens that
        # re-split), so a prompt's length settles in a step or two.
        texts = [self.tokenizer.decode([i]) for i in ids]
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        self._ids = [i for i, e in zip(ids, encoded) if e.ids == [i]]
        if not self._ids:
            raise PlannerError(f"tokenizer {str(tokenizer_file)!r} has no ordinary tokens")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def build(self, n_tokens: int, index: int) -> str:
        rng = random.Random(index)
        ids = [rng.choice(self._ids) for _ in range(n_tokens)]
        text = self.tokenizer.decode(ids)
        for _ in range(8):  # re-encoding merges or splits tokens: trim or pad until it settles
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == n_tokens:
                return text
            if len(ids) > n_tokens:
                text = self.tokenizer.decode(ids[:n_tokens])
            else:
                text = text + self.tokenizer.decode([rng.choice(self._ids) for _ in range(n_tokens - len(ids))])
        return text


def prompt_builder(model: str | None, tokenizer: str | None) -> PromptBuilder:
    """The tokenizer-backed builder when a tokenizer.json is at hand, else the approximate one."""
    for candidate in (tokenizer, model):
        if not candidate:
            continue
        path = Path(candidate)
        path = path / "tokenizer.json" if path.is_dir() else path
        if path.is_file() and path.name.endswith(".json"):
            logger.info("building prompts with the tokenizer %s", path)
            return TokenizerPrompts(path)
    if tokenizer:
        raise PlannerError(f"--tokenizer {tokenizer!r} is not a tokenizer.json file or a directory holding one")
    logger.info("no local tokenizer: prompts are approximated (one short word per token)")
    return ApproximatePrompts()


class WorkloadSource(Protocol):
    """Where requests come from."""

    def describe(self) -> Workload: ...

    def requests(self, count: int, offset: int = 0) -> list[RequestSpec]: ...


@dataclass(frozen=True)
class FixedLengths:
    """Every request: `input_tokens` in, exactly `output_tokens` out (ignore_eos)."""

    input_tokens: int
    output_tokens: int
    builder: PromptBuilder
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise PlannerError(f"input and output tokens must be >= 1, got {self.input_tokens}, {self.output_tokens}")

    def describe(self) -> Workload:
        return Workload("fixed", self.input_tokens, self.output_tokens)

    def requests(self, count: int, offset: int = 0) -> list[RequestSpec]:
        return [RequestSpec(self.builder.build(self.input_tokens, offset + i), self.output_tokens, self.ignore_eos)
                for i in range(count)]


@dataclass(frozen=True)
class Dataset:
    """Prompts (and output lengths) from a file, cycled when more requests are asked for than it holds."""

    kind: str
    path: str
    items: tuple[RequestSpec, ...]
    mean_input_tokens: int | None

    def describe(self) -> Workload:
        mean_out = round(sum(r.max_tokens for r in self.items) / len(self.items))
        return Workload(self.kind, self.mean_input_tokens, mean_out, self.path)

    def requests(self, count: int, offset: int = 0) -> list[RequestSpec]:
        return [self.items[(offset + i) % len(self.items)] for i in range(count)]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise PlannerError(f"cannot read workload file {path!r}: {exc.strerror}") from exc


def _mean_tokens(texts: Sequence[str], builder: PromptBuilder) -> int | None:
    counts = [builder.count(t) for t in texts]
    known = [c for c in counts if c is not None]
    return round(sum(known) / len(known)) if known and len(known) == len(counts) else None


def load_sharegpt(path: str, builder: PromptBuilder, default_output: int, ignore_eos: bool = True,
                  limit: int = 10_000) -> Dataset:
    """ShareGPT JSON: the first human turn is the prompt, the reply's length the output (parsed by the load
    tester's `parse_sharegpt`; lengths counted with the tokenizer when there is one, else estimated)."""
    tokens = TokenizerTokens(builder.tokenizer) if isinstance(builder, TokenizerPrompts) else EstimatedTokens()
    try:
        pairs = parse_sharegpt(json.loads(_read(path)), tokens)[:limit]
    except json.JSONDecodeError as exc:
        raise PlannerError(f"ShareGPT file {path!r} is not valid JSON: {exc}") from exc
    except ValueError as exc:
        raise PlannerError(f"ShareGPT file {path!r}: {exc}") from exc
    if not pairs:
        raise PlannerError(f"ShareGPT file {path!r} has no conversation with a human turn and a reply")
    items = tuple(RequestSpec(prompt, max(1, reply or default_output), ignore_eos) for prompt, _, reply in pairs)
    return Dataset("sharegpt", path, items, _mean_tokens([prompt for prompt, _, _ in pairs], builder))


def load_jsonl(path: str, builder: PromptBuilder, default_output: int, ignore_eos: bool = True) -> Dataset:
    """JSONL: each line a string prompt or {"prompt": str, "max_tokens": int (optional)}."""
    items, prompts = [], []
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlannerError(f"{path!r} line {number} is not valid JSON: {exc}") from exc
        prompt, out = (row, default_output) if isinstance(row, str) else (
            (row.get("prompt"), row.get("max_tokens", default_output)) if isinstance(row, dict) else (None, None))
        if not isinstance(prompt, str) or not isinstance(out, int) or out < 1:
            raise PlannerError(f"{path!r} line {number}: want a string or {{\"prompt\": str, \"max_tokens\": int}}")
        items.append(RequestSpec(prompt, out, ignore_eos))
        prompts.append(prompt)
    if not items:
        raise PlannerError(f"JSONL file {path!r} has no prompts")
    return Dataset("jsonl", path, tuple(items), _mean_tokens(prompts, builder))
