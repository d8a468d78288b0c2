"""Workloads: what each request asks for (prompt and max_tokens), seeded and random-access by index.

Request i is drawn from its own generator seeded with (seed, i), so the same seed gives the same
requests in any order, in any process, and an open-ended closed-loop run can ask for request i forever.

Synthetic prompts are common English words, one per wanted input token: most BPE tokenizers (GPT-2,
OPT, Llama) encode each as one token, so the prompt length is close to, not exactly, the wanted one.
Given the served model's tokenizer (`tokenizer`: a tokenizer.json or a directory holding one), prompts
are cut to the wanted number of tokens instead, and ShareGPT lengths are counted with it. The server's
own count (`usage.prompt_tokens`) is what the report uses when the server gives it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

WORKLOADS = ("fixed", "uniform", "lognormal", "sharegpt", "mix", "multiturn")

WORDS = tuple(
    "the of and to in is was for on that with as by at from his her it an were are which this be or had not but "
    "first one their they its new after who also two has been other more time all when during into there would "
    "can only most some over city three years state world about such than may later these then where school "
    "before many made under between both life high part work well people team used since while year game "
    "music film water house land local power money group party river order light north south east west".split()
)


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt, the prompt's estimated tokens and the output tokens to ask for."""

    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int
    history: tuple[tuple[str, str], ...] = ()  # multi-turn: (role, text) of the messages before this prompt
    conversation: int | None = None  # multi-turn: which conversation, and which of its turns (0-based)
    turn: int | None = None
    model: str | None = None  # the model (a LoRA adapter) this request names; None: the run's --model


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload to draw, and its parameters."""

    kind: str = "fixed"
    input_len: int = 512
    output_len: int = 256
    range_ratio: float = 0.5  # uniform: lengths in [len*(1-r), len*(1+r)]
    sigma: float = 0.5  # lognormal: log-space spread, median = len
    dataset: str | None = None  # ShareGPT-format JSON file
    sharegpt_output_len: int | None = None  # override the dataset's reply lengths
    short: tuple[int, int] = (128, 32)  # mix: (input, output) of a short request
    long: tuple[int, int] = (2048, 512)  # mix: (input, output) of a long request
    long_fraction: float = 0.2
    tokenizer: str | None = None  # tokenizer.json, or a model directory holding one
    prompt_salt: int = 0  # other prompt text, same lengths: no prefix-cache hits from an earlier run
    seed: int = 0
    turns: tuple[int, int] = (2, 8)  # multiturn: turns per conversation, min and max
    system_len: int = 256  # multiturn: the shared system prompt's tokens
    think_time: float = 5.0  # multiturn: mean seconds between a reply and the next message (exponential)
    max_context: int = 2048  # multiturn: a conversation ends before a turn that would pass this many tokens
    adapters: tuple[str, ...] = ()  # LoRA adapters the requests name, the first the most popular (Zipf)
    zipf_s: float = 1.0  # adapter popularity: the k-th adapter named with probability proportional to 1 / k^s

    def __post_init__(self) -> None:
        if any(not isinstance(a, str) or not a for a in self.adapters):
            raise ValueError(f"adapters {self.adapters!r} must be non-empty names")
        if not self.zipf_s >= 0:
            raise ValueError(f"zipf exponent {self.zipf_s!r} must be >= 0")
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload {self.kind!r} is not one of {', '.join(WORKLOADS)}")
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r} must be >= 1 token")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range ratio {self.range_ratio!r} must be in [0, 1)")
        if not self.sigma >= 0:
            raise ValueError(f"sigma {self.sigma!r} must be >= 0")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long fraction {self.long_fraction!r} must be in [0, 1]")
        if min(*self.short, *self.long) < 1:
            raise ValueError(f"short {self.short!r} and long {self.long!r} lengths must be >= 1 token")
        if self.kind == "sharegpt" and not self.dataset:
            raise ValueError("workload 'sharegpt' needs a dataset file (--dataset PATH)")
        if self.seed < 0 or self.prompt_salt < 0:
            raise ValueError(f"seed {self.seed!r} and prompt salt {self.prompt_salt!r} must be >= 0")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"sharegpt output len {self.sharegpt_output_len!r} must be >= 1 token")
        if not 1 <= self.turns[0] <= self.turns[1]:
            raise ValueError(f"turns {self.turns[0]}:{self.turns[1]} must be MIN:MAX with 1 <= MIN <= MAX")
        if self.system_len < 0 or self.max_context < 1:
            raise ValueError(f"system len {self.system_len!r} must be >= 0 and max context {self.max_context!r} >= 1")
        if not self.think_time >= 0:
            raise ValueError(f"think time {self.think_time!r} must be >= 0 seconds")


class Workload(Protocol):
    """Gives request `index` of a seeded workload."""

    def request(self, index: int) -> RequestSpec: ...


class Tokens(Protocol):
    """Counts tokens, and cuts text to a number of tokens."""

    def count(self, text: str) -> int: ...

    def fit(self, text: str, tokens: int) -> str: ...


class EstimatedTokens:
    """No tokenizer: about four characters per token; random-word prompts are left as they are."""

    def count(self, text: str) -> int:
        return estimate_tokens(text)

    def fit(self, text: str, tokens: int) -> str:
        return text


@dataclass(frozen=True)
class TokenizerTokens:
    """A Hugging Face `tokenizers` tokenizer (the served model's)."""

    tokenizer: Any

    @classmethod
    def load(cls, path: str) -> TokenizerTokens:
        from tokenizers import Tokenizer  # only when asked for: a large import

        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        try:
            return cls(Tokenizer.from_file(str(file)))
        except Exception as e:  # the library raises a bare Exception for unreadable or invalid files
            raise ValueError(f"tokenizer {path!r} cannot be loaded: {e}") from e

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def fit(self, text: str, tokens: int) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return str(self.tokenizer.decode(ids[:tokens]))


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


def synthetic_prompt(rng: np.random.Generator, tokens: int) -> str:
    """A prompt of `tokens` random common words (about one token each)."""
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), tokens))


def _uniform(rng: np.random.Generator, length: int, ratio: float) -> int:
    low = max(1, math.floor(length * (1 - ratio)))
    return int(rng.integers(low, max(low, math.floor(length * (1 + ratio))) + 1))


@dataclass(frozen=True)
class Synthetic:
    """Random-word prompts whose (input, output) lengths come from `spec.kind`'s distribution."""

    spec: WorkloadSpec
    tokens: Tokens = field(default_factory=EstimatedTokens)

    def lengths(self, rng: np.random.Generator) -> tuple[int, int]:
        s = self.spec
        if s.kind == "uniform":
            return _uniform(rng, s.input_len, s.range_ratio), _uniform(rng, s.output_len, s.range_ratio)
        if s.kind == "lognormal":
            factors = np.exp(s.sigma * rng.standard_normal(2))
            return max(1, round(s.input_len * factors[0])), max(1, round(s.output_len * factors[1]))
        if s.kind == "mix":
            return s.long if rng.random() < s.long_fraction else s.short
        return s.input_len, s.output_len

    def request(self, index: int) -> RequestSpec:
        n_in, n_out = self.lengths(_rng(self.spec.seed, index))
        words = np.random.default_rng([self.spec.seed, index, self.spec.prompt_salt, 1])
        # Every word is at least one token, so n_in words hold at least n_in tokens to cut from.
        prompt = self.tokens.fit(synthetic_prompt(words, n_in), n_in)
        return RequestSpec(index, prompt, n_in, n_out)


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate: about four characters per token for English text."""
    return max(1, math.ceil(len(text) / 4))


@dataclass(frozen=True)
class ShareGpt:
    """Prompts and reply lengths from a ShareGPT-format file, in a seeded order, cycling when exhausted."""

    pairs: tuple[tuple[str, int, int], ...]  # (first human turn, its tokens, the reply's tokens)
    order: tuple[int, ...]
    output_len: int | None
    salt: int = 0

    @classmethod
    def load(cls, path: str, seed: int, output_len: int | None = None, tokens: Tokens | None = None,
             salt: int = 0) -> ShareGpt:
        pairs = tuple(parse_sharegpt(read_json(path), tokens or EstimatedTokens()))
        if not pairs:
            raise ValueError(f"dataset {path!r} has no conversation that starts with a human turn and a reply")
        order = tuple(int(i) for i in np.random.default_rng(seed).permutation(len(pairs)))
        return cls(pairs, order, output_len, salt)

    def request(self, index: int) -> RequestSpec:
        prompt, prompt_tokens, reply_tokens = self.pairs[self.order[index % len(self.order)]]
        if self.salt:
            prompt = f"({self.salt}) {prompt}"  # a different first token: no prefix-cache hits; a few tokens more
        return RequestSpec(index, prompt, prompt_tokens, self.output_len or reply_tokens)


def read_json(path: str) -> object:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"dataset {path!r} cannot be read: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset {path!r} is not JSON: {e}") from e


def sharegpt_chat_texts(data: object) -> list[list[tuple[str, str]]]:
    """Each ShareGPT conversation's (human message, reply) texts, up to its first malformed or empty turn."""
    if not isinstance(data, list):
        raise ValueError("a ShareGPT dataset is a JSON list of {\"conversations\": [...]} objects")
    chats = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        pairs = []
        for human, gpt in zip(turns[::2], turns[1::2]):
            if not (isinstance(human, dict) and isinstance(gpt, dict)) or human.get("from") != "human" \
                    or not human.get("value") or not gpt.get("value"):
                break
            pairs.append((str(human["value"]), str(gpt["value"])))
        if pairs:
            chats.append(pairs)
    return chats


def parse_sharegpt(data: object, tokens: Tokens) -> list[tuple[str, int, int]]:
    """(prompt, prompt tokens, reply tokens) from ShareGPT JSON: a list of
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}."""
    if not isinstance(data, list):
        raise ValueError("a ShareGPT dataset is a JSON list of {\"conversations\": [...]} objects")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, Sequence) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") != "human" or not first.get("value") or not second.get("value"):
            continue
        prompt = str(first["value"])
        pairs.append((prompt, tokens.count(prompt), tokens.count(str(second["value"]))))
    return pairs


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Probabilities of ranks 1..n under Zipf's law with exponent `s` (s = 0: uniform)."""
    weights = 1.0 / np.arange(1, n + 1) ** s
    return np.asarray(weights / weights.sum())


@dataclass(frozen=True)
class WithAdapters:
    """Another workload's requests, each naming one of `adapters`, drawn by Zipf popularity (seeded per index)."""

    inner: Workload
    adapters: tuple[str, ...]
    zipf_s: float
    seed: int

    def request(self, index: int) -> RequestSpec:
        spec = self.inner.request(index)
        rng = np.random.default_rng([self.seed, index, 2])
        name = self.adapters[int(rng.choice(len(self.adapters), p=zipf_weights(len(self.adapters), self.zipf_s)))]
        return replace(spec, model=name)


def build_workload(spec: WorkloadSpec) -> Workload:
    """The workload `spec` describes (a ShareGPT file is read here, once)."""
    tokens = TokenizerTokens.load(spec.tokenizer) if spec.tokenizer else EstimatedTokens()
    workload: Workload
    if spec.kind == "sharegpt":
        assert spec.dataset is not None  # checked by WorkloadSpec
        workload = ShareGpt.load(spec.dataset, spec.seed, spec.sharegpt_output_len, tokens, spec.prompt_salt)
    else:
        workload = Synthetic(spec, tokens)
    return WithAdapters(workload, spec.adapters, spec.zipf_s, spec.seed) if spec.adapters else workload
