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
