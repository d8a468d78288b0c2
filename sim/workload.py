"""Request mixes and arrival processes for simulated experiments.

- `sharegpt_like`: prompt and output lengths drawn from truncated lognormals, with ShareGPT's filter as in
  vLLM's benchmark (prompt <= 1024, prompt + output <= 2048, both >= 4). The means default to the reference
  run's own (110.6 prompt and 291.6 output tokens per request: total and output tokens/s divided by
  requests/s, the same on every row); the spreads (sigma) are assumed, ShareGPT-like heavy tails.
- `mixed`: short chat-like requests with a fraction of long ones (long prompts, long outputs).
- `poisson_arrivals` / `gamma_arrivals`: open-loop arrival times at a given rate; gamma with CV > 1 is bursty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadtest.workloads import sharegpt_chat_texts

REFERENCE_PROMPT_MEAN = 110.6
REFERENCE_OUTPUT_MEAN = 291.6


@dataclass(frozen=True)
class RequestSpec:
    """One request's size: prompt tokens and output tokens (generated to the end: ignore_eos)."""

    prompt_tokens: int
    output_tokens: int


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def truncated_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[X | lo <= X <= hi] for X lognormal(mu, sigma)."""
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    mass = _phi(b) - _phi(a)
    return math.exp(mu + sigma**2 / 2) * (_phi(b - sigma) - _phi(a - sigma)) / mass


def mu_for_mean(mean: float, sigma: float, lo: float, hi: float) -> float:
    """The lognormal mu whose truncation to [lo, hi] has the given mean (bisection)."""
    low, high = math.log(lo) - 5 * sigma, math.log(hi) + 5 * sigma
    for _ in range(100):
        mid = (low + high) / 2
        if truncated_lognormal_mean(mid, sigma, lo, hi) < mean:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def sharegpt_like(n: int, rng: np.random.Generator, prompt_mean: float = REFERENCE_PROMPT_MEAN,
                  output_mean: float = REFERENCE_OUTPUT_MEAN, prompt_sigma: float = 1.0,
                  output_sigma: float = 0.8, max_prompt: int = 1024, max_total: int = 2048) -> list[RequestSpec]:
    """`n` requests with ShareGPT-like lognormal prompt and output lengths (see module docstring)."""
    mu_p = mu_for_mean(prompt_mean, prompt_sigma, 4, max_prompt)
    mu_o = mu_for_mean(output_mean, output_sigma, 4, max_total - 4)
    out: list[RequestSpec] = []
    while len(out) < n:
        p = np.rint(rng.lognormal(mu_p, prompt_sigma, 2 * n)).astype(int)
        o = np.rint(rng.lognormal(mu_o, output_sigma, 2 * n)).astype(int)
        keep = (p >= 4) & (o >= 4) & (p <= max_prompt) & (p + o <= max_total)
        out += [RequestSpec(int(a), int(b)) for a, b in zip(p[keep], o[keep])]
    return out[:n]


def mixed(n: int, rng: np.random.Generator, long_fraction: float = 0.1,
          short_prompt: tuple[int, int] = (32, 256), short_output: tuple[int, int] = (16, 128),
          long_prompt: tuple[int, int] = (768, 1280), long_output: tuple[int, int] = (384, 768)) -> list[RequestSpec]:
    """Short requests (uniform in the short ranges) mixed with `long_fraction` long ones."""
    is_long = rng.random(n) < long_fraction
    specs = []
    for long_ in is_long:
        prompt, output = (long_prompt, long_output) if long_ else (short_prompt, short_output)
        specs.append(RequestSpec(int(rng.integers(prompt[0], prompt[1] + 1)),
                                 int(rng.integers(output[0], output[1] + 1))))
    return specs


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` per second."""
    return np.cumsum(rng.exponential(1 / rate, n))


def gamma_arrivals(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times with gamma inter-arrival gaps of mean 1/rate and coefficient of variation `cv` (>1: bursty)."""
    shape = 1 / cv**2
    return np.cumsum(rng.gamma(shape, 1 / (rate * shape), n))


def mean_tokens(specs: list[RequestSpec]) -> tuple[float, float]:
    """Mean prompt and output tokens of a list of requests."""
    return (float(np.mean([s.prompt_tokens for s in specs])), float(np.mean([s.output_tokens for s in specs])))


# -- multi-turn chat ----------------------------------------------------------------------------------------

SYSTEM_SEGMENT = 1  # the system prompt's segment id: the same in every conversation


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation: the user's new message and the reply's length, in tokens."""

    user_tokens: int
    output_tokens: int
    think_s: float = 0.0  # the user's pause before sending this turn (after the previous reply ended)


@dataclass(frozen=True)
class Conversation:
    """A chat: a shared system prompt, then turns whose prompt is the whole history so far plus the new message."""

    cid: int
    start: float
    system_tokens: int
    turns: tuple[Turn, ...]

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt (0-based): system prompt, every earlier message and reply, the new one."""
        done = self.turns[:turn]
        return self.system_tokens + sum(t.user_tokens + t.output_tokens for t in done) + self.turns[turn].user_tokens

    def history_tokens(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt that only earlier turns of this conversation sent (0 for the first)."""
        return self.prompt_tokens(turn) - self.system_tokens - self.turns[turn].user_tokens

    def segments(self) -> list[tuple[int, int]]:
        """The whole conversation's tokens as (segment id, length): system, user 1, reply 1, user 2, ..."""
        out = [(SYSTEM_SEGMENT, self.system_tokens)] if self.system_tokens else []
        for i, t in enumerate(self.turns):
            out += [(hash((2, self.cid, i)), t.user_tokens), (hash((3, self.cid, i)), t.output_tokens)]
        return out

    def block_hashes(self, block_size: int = 16) -> list[int]:
        """Chained hashes of the conversation's full blocks: turn i's prompt and reply are a prefix of it."""
        return block_hashes(self.segments(), block_size)


def block_hashes(segments: list[tuple[int, int]], block_size: int) -> list[int]:
    """Chained hashes (as vLLM's prefix cache keys) of the full blocks of a sequence given as (segment, length).

    A block's hash covers the previous block's hash and the (segment, offset) pieces it holds, so two sequences
    share a block hash exactly when they share every token up to the end of that block.
    """
    hashes: list[int] = []
    prev, pieces, filled = 0, [], 0
    for seg, length in segments:
        offset = 0
        while offset < length:
            take = min(block_size - filled, length - offset)
            pieces.append((seg, offset))
            filled += take
            offset += take
            if filled == block_size:
                prev = hash((prev, *pieces))
                hashes.append(prev)
                pieces, filled = [], 0
    return hashes


def conversations(n: int, rate: float, rng: np.random.Generator, system_tokens: int = 256,
                  turns: tuple[int, int] = (2, 8), user_mean: float = 60.0, output_mean: float = 160.0,
                  think_mean_s: float = 5.0, sigma: float = 0.8, max_len: int = 2048,
                  arrivals: np.ndarray | None = None) -> list[Conversation]:
    """`n` synthetic chats starting at `rate` per second (Poisson, or the given start times).

    Each has a uniform number of turns in `turns`, lognormal user messages and replies (ShareGPT-like spread,
    the given means) and exponential think times; turns stop before the prompt plus reply would pass `max_len`.
    """
    starts = arrivals if arrivals is not None else poisson_arrivals(n, rate, rng)
    out = []
    for cid in range(n):
        count = int(rng.integers(turns[0], turns[1] + 1))
        users = np.maximum(1, np.rint(rng.lognormal(math.log(user_mean) - sigma**2 / 2, sigma, count))).astype(int)
        outs = np.maximum(4, np.rint(rng.lognormal(math.log(output_mean) - sigma**2 / 2, sigma, count))).astype(int)
        thinks = rng.exponential(think_mean_s, count)
        kept: list[Turn] = []
        length = system_tokens
        for u, o, th in zip(users, outs, thinks):
            if length + u + o > max_len:
                break
            kept.append(Turn(int(u), int(o), float(th) if kept else 0.0))
            length += u + o
        if kept:
            out.append(Conversation(cid, float(starts[cid]), system_tokens, tuple(kept)))
    return out


def sharegpt_conversations(data: object, rate: float, rng: np.random.Generator, n: int | None = None,
                           system_tokens: int = 256, think_mean_s: float = 5.0, max_len: int = 2048,
                           bytes_per_token: int = 4) -> list[Conversation]:
    """Chats from ShareGPT-format JSON: each human turn a user message, each gpt turn the reply's length.

    Lengths are estimated at `bytes_per_token`; conversations are taken in a seeded order, starting at `rate`
    per second (Poisson), each cut where its prompt plus reply would pass `max_len`.
    """
    def tokens(text: str) -> int:
        return -(-len(text.encode()) // bytes_per_token)

    chats = [[(tokens(u), tokens(o)) for u, o in chat] for chat in sharegpt_chat_texts(data)]
    if not chats:
        raise ValueError("the dataset has no conversation that starts with a human turn and a reply")
    order = rng.permutation(len(chats))
    count = n if n is not None else len(chats)
    starts = poisson_arrivals(count, rate, rng)
    thinks = rng.exponential(think_mean_s, (count, max(len(c) for c in chats)))
    out = []
    for cid in range(count):
        kept: list[Turn] = []
        length = system_tokens
        for i, (u, o) in enumerate(chats[order[cid % len(chats)]]):
            if length + u + o > max_len:
                break
            kept.append(Turn(u, o, float(thinks[cid, i]) if kept else 0.0))
            length += u + o
        if kept:
            out.append(Conversation(cid, float(starts[cid]), system_tokens, tuple(kept)))
    return out
