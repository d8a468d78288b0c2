"""Multi-turn chat workloads (`--workload multiturn`): conversations whose history grows turn by turn.

Every conversation opens with one system prompt shared by all of them, then sends its turns one after another:
each turn's request carries the whole history (the system prompt, every earlier user message and the reply the
server actually streamed back) plus the new user message, after a think time following the previous reply, as a
chat client does. So a server with prefix caching can reuse the history, and a gateway can keep each conversation
on the replica that holds it.

Synthetic conversations (the default) have a uniform number of turns in `--turns MIN:MAX`, user messages of
`--input-len` random words and replies of `--output-len` tokens. With `--dataset` (ShareGPT format) each
conversation's human turns are the user messages, in order, and its gpt turns' lengths the replies' max_tokens.
Conversation i is seeded by (seed, i), as single requests are. A conversation stops before a turn whose prompt
plus reply would pass `--max-context` tokens.

With `--endpoint completions` the history is laid out in one prompt ("System: ...\\n\\nUser: ...\\n\\nAssistant:"),
so each turn's prompt starts with the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from loadtest.workloads import (EstimatedTokens, Tokens, TokenizerTokens, WorkloadSpec, read_json, sharegpt_chat_texts,
                                synthetic_prompt)

CHAT_OVERHEAD_TOKENS = 4  # what a chat template adds per message, about


@dataclass(frozen=True)
class TurnSpec:
    """One turn: the user's new message, its tokens, the reply's max_tokens, the pause before sending it."""

    message: str
    message_tokens: int
    max_tokens: int
    think_s: float


@dataclass(frozen=True)
class ChatSpec:
    """One conversation: the shared system prompt and its turns."""

    index: int
    system: str
    system_tokens: int
    turns: tuple[TurnSpec, ...]


class Chats(Protocol):
    """Gives conversation `index` of a seeded multi-turn workload."""

    def chat(self, index: int) -> ChatSpec: ...


def _system(spec: WorkloadSpec, tokens: Tokens) -> str:
    """The system prompt every conversation shares (another with another prompt salt)."""
    rng = np.random.default_rng([spec.seed, spec.prompt_salt, 7])
    return tokens.fit(synthetic_prompt(rng, spec.system_len), spec.system_len)


def _turns(spec: WorkloadSpec, rng: np.random.Generator, lengths: Sequence[tuple[str, int, int]]) -> tuple[TurnSpec,
                                                                                                           ...]:
    """The turns that fit in max_context, with exponential think times (none before the first)."""
    out: list[TurnSpec] = []
    context = spec.system_len + CHAT_OVERHEAD_TOKENS
    for message, tokens, reply in lengths:
        context += tokens + reply + 2 * CHAT_OVERHEAD_TOKENS
        if context > spec.max_context:
            break
        think = float(rng.exponential(spec.think_time)) if out and spec.think_time > 0 else 0.0
        out.append(TurnSpec(message, tokens, reply, think))
    return tuple(out)


@dataclass(frozen=True)
class SyntheticChats:
    """Conversations of random-word messages."""

    spec: WorkloadSpec
    tokens: Tokens
    system: str

    def chat(self, index: int) -> ChatSpec:
        s = self.spec
        rng = np.random.default_rng([s.seed, index, 11])
        words = np.random.default_rng([s.seed, index, s.prompt_salt, 12])
        count = int(rng.integers(s.turns[0], s.turns[1] + 1))
        lengths = [(self.tokens.fit(synthetic_prompt(words, s.input_len), s.input_len), s.input_len, s.output_len)
                   for _ in range(count)]
        return ChatSpec(index, self.system, s.system_len, _turns(s, rng, lengths))


@dataclass(frozen=True)
class ShareGptChats:
    """Conversations from a ShareGPT file, in a seeded order, cycling when exhausted."""

    spec: WorkloadSpec
    system: str
    chats: tuple[tuple[tuple[str, int, int], ...], ...]  # per conversation: (human message, its tokens, reply tokens)
    order: tuple[int, ...]

    def chat(self, index: int) -> ChatSpec:
        rng = np.random.default_rng([self.spec.seed, index, 11])
        turns = self.chats[self.order[index % len(self.order)]]
        if self.spec.sharegpt_output_len:
            turns = tuple((m, t, self.spec.sharegpt_output_len) for m, t, _ in turns)
        return ChatSpec(index, self.system, self.spec.system_len, _turns(self.spec, rng, turns))


def parse_sharegpt_chats(data: object, tokens: Tokens) -> list[tuple[tuple[str, int, int], ...]]:
    """Each conversation's (human message, its tokens, the reply's tokens), up to its first malformed turn."""
    return [tuple((message, tokens.count(message), max(1, tokens.count(reply))) for message, reply in chat)
            for chat in sharegpt_chat_texts(data)]


def build_chats(spec: WorkloadSpec) -> Chats:
    """The multi-turn workload `spec` describes (a ShareGPT file is read here, once)."""
    tokens: Tokens = TokenizerTokens.load(spec.tokenizer) if spec.tokenizer else EstimatedTokens()
    system = _system(spec, tokens)
    if not spec.dataset:
        return SyntheticChats(spec, tokens, system)
    chats = parse_sharegpt_chats(read_json(spec.dataset), tokens)
    if not chats:
        raise ValueError(f"dataset {spec.dataset!r} has no conversation that starts with a human turn and a reply")
    order = tuple(int(i) for i in np.random.default_rng(spec.seed).permutation(len(chats)))
    return ShareGptChats(spec, system, tuple(chats), order)


def completion_prompt(history: Sequence[tuple[str, str]], message: str) -> str:
    """A conversation laid out as one completions prompt; the next turn's prompt starts with this one."""
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    parts = [f"{names.get(role, role)}: {text}" for role, text in history]
    return "\n\n".join([*parts, f"User: {message}", "Assistant:"])
