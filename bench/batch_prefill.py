"""What a step that prefills several prompts costs a real replica: k prompts of n tokens in ONE completions request.

`bench.prefill_cost` sends one prompt at a time, so its fixed cost (a prefill of n tokens = base + per token x n +
per pair x pairs) cannot tell a cost per step from a cost per prompt. A burst prefills several prompts in one step,
and there the two differ: k prompts cost k x base more under the second. Here each shape's k prompts (random token
ids, nothing cached, `max_tokens` 1) go in one request, so vLLM's API server hands them over at once, on an idle
replica. The engine, woken by the first, usually takes it alone and the rest in the next step; the split is read
from `vllm:iteration_tokens_total`'s buckets (a step of j prompts counts j x (n + 1) tokens), and a probe whose
split the buckets leave open is dropped. The reading is vLLM's mean `request_prefill_time_seconds` over the k (a
prompt's step, from its scheduling to its first token). Then a least-squares fit of a step's time over the probes,

    step_s = base + per_prompt x j + per_token x j x n + per_pair x j x n^2 / 2

each probe's mean the prompts' average over their steps. `per_prompt` is what a prompt costs beyond its tokens
and attention; near 0, a prefill's fixed part is the step's.

    python -m bench.batch_prefill --replica http://127.0.0.1:8001 --reps 7 --out runs/batch_prefill.json
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .prefill_cost import idle_replica_parser, served

SHAPES = ((1, 64), (1, 128), (1, 256), (1, 512), (1, 768), (1, 1024), (2, 64), (2, 128), (2, 256), (2, 512),
          (3, 128), (4, 64), (4, 128), (4, 256), (6, 128), (8, 64), (8, 128), (12, 64), (16, 64), (24, 32), (32, 32))
PREFILL, COUNT = "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count"
STEPS, BUCKET = "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_bucket"


@dataclass(frozen=True)
class Probe:
    """One request of `k` prompts of `n` tokens: vLLM's mean prefill over them (ms), and the prompts per step."""

    k: int
    n: int
    prefill_ms: float
    split: tuple[int, ...] | None  # prompts per step, in order; None: the buckets left it open


@dataclass(frozen=True)
class Fit:
    """step_ms = base_ms + per_prompt_ms x j + per_token_us x tokens / 1e3 + per_pair_ns x pairs / 1e6."""

    base_ms: float
    per_prompt_ms: float
    per_token_us: float
    per_pair_ns: float
    rms_ms: float
    probes: int


@dataclass(frozen=True)
class Scrape:
    """The counters a probe reads before and after: prefill sum (s) and count, steps, and steps per bucket."""

    prefill_s: float
    prefilled: float
    steps: float
    buckets: dict[float, float]  # upper edge -> cumulative steps


def scrape(url: str, timeout_s: float = 5.0) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    sums: Counter[str] = Counter()
    buckets: Counter[float] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == BUCKET:
                buckets[float(sample.labels["le"])] += sample.value
            elif sample.name in (PREFILL, COUNT, STEPS):
                sums[sample.name] += sample.value
    return Scrape(sums[PREFILL], sums[COUNT], sums[STEPS], dict(buckets))


def compositions(k: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut k prompts, in order, into `parts` steps of at least one."""
    if parts == 1:
        yield (k,)
        return
    for first in range(1, k - parts + 2):
        for rest in compositions(k - first, parts - 1):
            yield (first, *rest)


def per_bucket(edges: Sequence[float], tokens: Sequence[int]) -> dict[float, int]:
    """Steps of these token counts in each bucket (the smallest edge at or above the count)."""
    counts = dict.fromkeys(edges, 0)
    for t in tokens:
        counts[min(e for e in edges if e >= t)] += 1
    return counts


def split_of(k: int, n: int, before: Scrape, after: Scrape) -> tuple[int, ...] | None:
    """The prompts per step that the steps taken and their buckets allow, where only one does (a step of j
    prompts counts j x (n + 1) tokens: its prompts and their first tokens). Without buckets (`sim serve` exports
    the count and sum only) only one step, or one prompt a step, is certain."""
    steps = round(after.steps - before.steps)
    if steps < 1 or steps > k:
        return None
    candidates = list(compositions(k, steps))
    edges = sorted(after.buckets)
    if len(candidates) == 1 or not edges:
        return candidates[0] if len(candidates) == 1 else None
    seen, below = {}, 0.0
    for edge in edges:
        cumulative = after.buckets[edge] - before.buckets.get(edge, 0.0)
        seen[edge], below = round(cumulative - below), cumulative
    matches = {tuple(sorted(c)) for c in candidates if per_bucket(edges, [j * (n + 1) for j in c]) == seen}
    if len(matches) != 1:
        return None
    return next(iter(matches))  # the steps' sizes, not their order: the mean prefill does not depend on it


def probe(url: str, model: str, k: int, n: int, rng: random.Random, timeout_s: float = 60.0) -> Probe:
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for _ in range(k)]
    body = json.dumps({"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 0}).encode()
    before = scrape(url)
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        resp.read()
    after = scrape(url)
    count = after.prefilled - before.prefilled
    if count != k:
        raise RuntimeError(f"{url}: a probe of {k} prompts, and the replica prefilled {count:g}: is it idle?")
    return Probe(k, n, (after.prefill_s - before.prefill_s) / k * 1e3, split_of(k, n, before, after))


def features(n: int, split: Sequence[int]) -> np.ndarray:
    """A probe's mean prefill as a combination of the fit's terms: each prompt waits for its own step."""
    k = sum(split)
    rows = [j * np.array([1.0, j, j * n, j * n * n / 2]) for j in split]
    return np.sum(rows, axis=0) / k


def fit(probes: Sequence[Probe]) -> Fit:
    """Least squares over the probes with a known split (relative error, so short steps count as much)."""
    used = [(p, p.split) for p in probes if p.split is not None]
    if len(used) < 4:
        raise ValueError(f"need at least 4 probes with a known split to fit 4 terms, got {len(used)}")
    x = np.array([features(p.n, split) for p, split in used])
    y = np.array([p.prefill_ms for p, _ in used])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    rms = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return Fit(float(coef[0]), float(coef[1]), float(coef[2]) * 1e3, float(coef[3]) * 1e6, rms, len(used))


def measure(url: str, reps: int, seed: int = 0, shapes: Sequence[tuple[int, int]] = SHAPES) -> list[Probe]:
    """Every shape that fits the replica's context and batch, `reps` rounds, each round the shapes shuffled."""
    model, max_model_len = served(url)
    rng = random.Random(seed)
    probe(url, model, 1, 16, rng)  # the first request's warm-up
    usable = [(k, n) for k, n in shapes if max_model_len is None or n + 1 <= max_model_len]
    probes = []
    for _ in range(reps):
        order = list(usable)
        rng.shuffle(order)
        probes += [probe(url, model, k, n, rng) for k, n in order]
    return probes


def report(probes: Sequence[Probe], result: Fit) -> list[str]:
    lines = ["prompts x tokens | mean prefill ms (median) | fitted | splits seen"]
    by_shape: dict[tuple[int, int], list[Probe]] = {}
    for p in probes:
        by_shape.setdefault((p.k, p.n), []).append(p)
    coef = np.array([result.base_ms, result.per_prompt_ms, result.per_token_us / 1e3, result.per_pair_ns / 1e6])
    for (k, n), group in sorted(by_shape.items()):
        known = [float(features(n, p.split) @ coef) for p in group if p.split is not None]
        fitted = f"{statistics.median(known):.2f}" if known else "-"
        splits = Counter("+".join(map(str, p.split)) if p.split else "?" for p in group)
        lines.append(f"{k:>3} x {n:<5}| {statistics.median(p.prefill_ms for p in group):8.2f} | {fitted:>6} | "
                     + ", ".join(f"{s}: {c}" for s, c in splits.most_common()))
    lines.append(f"fit over {result.probes} probes: a step {result.base_ms:.2f} ms + {result.per_prompt_ms:.3f} ms a "
                 f"prompt + {result.per_token_us:.1f} us a token + {result.per_pair_ns:.1f} ns a pair "
                 f"(rms {result.rms_ms:.2f} ms)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = idle_replica_parser("python -m bench.batch_prefill", __doc__, "an idle replica's URL (vLLM, or sim serve)",
                                 "write the probes and the fit here (JSON)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    url = args.replica.rstrip("/")
    try:
        probes = measure(url, args.reps, args.seed)
        result = fit(probes)
    except (urllib.error.URLError, OSError, KeyError, ValueError, RuntimeError) as exc:
        print(f"bench.batch_prefill: {url}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(report(probes, result)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"replica": url, "probes": [asdict(p) for p in probes],
                                        "fit": asdict(result)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
