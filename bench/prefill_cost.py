"""What one prefill costs a real replica, by the prompt tokens it computes and the cached context they attend to.

One request at a time on an idle replica: a prompt of `cached` tokens the replica has just seen (sent once before,
so its full blocks are in the prefix cache) followed by `new` tokens it has not, `max_tokens` 1. The reading is
vLLM's own `vllm:request_prefill_time_seconds` for that request (the engine's time from scheduling it to its first
token: one step here, the whole prompt fitting the chunk budget), the median over `reps` prompts of random token
ids; each reading checks from `vllm:prefix_cache_hits` that the cached part was a hit. Then a least-squares fit

    prefill_s = base + per_token x new + per_pair x new x (cached + new / 2)

where the last term counts the (query, key) pairs the new tokens' attention computes: a chat turn's uncached end
attends to the whole history before it. `sim calibrate --prefill-cost FILE` takes the fitted `per_pair`.

    python -m bench.prefill_cost --replica http://127.0.0.1:8001 --out runs/prefill_cost.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .engine_speed import counters

PREFILL = ("vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count")
HITS = "vllm:prefix_cache_hits_total"
CELLS = ((0, 128), (0, 384), (0, 1024), (0, 1536), (256, 128), (256, 384), (512, 128), (512, 384), (512, 1024),
         (1024, 128), (1024, 384), (1024, 896), (1536, 128), (1536, 384))


def attention_pairs(cached: float, new: float) -> float:
    """The (query, key) pairs `new` tokens after `cached` ones compute: each attends to those before it and itself."""
    return new * (cached + new / 2)


@dataclass(frozen=True)
class Reading:
    """A cell's median prefill (ms) over its reps, and the cached tokens the replica found per request."""

    cached: int
    new: int
    prefill_ms: float
    hit_tokens: float
    reps: int

    @property
    def pairs(self) -> float:
        return attention_pairs(self.cached, self.new)


@dataclass(frozen=True)
class Fit:
    """prefill_s = base_s + per_token_s x new + per_pair_s x pairs; `errors`: each cell's fit over its reading - 1."""

    base_s: float
    per_token_s: float
    per_pair_s: float
    errors: tuple[float, ...]

    def predict_s(self, cached: float, new: float) -> float:
        return self.base_s + self.per_token_s * new + self.per_pair_s * attention_pairs(cached, new)


def fit(readings: Sequence[Reading]) -> Fit:
    """Least squares in relative error (each cell weighted by 1 / its reading), so short prefills count as much as
    long ones."""
    if len(readings) < 3:
        raise ValueError(f"need at least 3 cells to fit 3 parameters, got {len(readings)}")
    y = np.array([r.prefill_ms / 1e3 for r in readings])
    x = np.array([[1.0, r.new, r.pairs] for r in readings])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    base, per_token, per_pair = (float(c) for c in coef)
    return Fit(base, per_token, per_pair, tuple(float(e) for e in x @ coef / y - 1))


def complete(url: str, model: str, prompt: list[int], timeout_s: float) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        resp.read()


def served(url: str, timeout_s: float = 10.0) -> tuple[str, int | None]:
    """The replica's model name and its context length (vLLM's /v1/models gives both; None where it does not)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout_s) as resp:
        first = json.loads(resp.read())["data"][0]
    length = first.get("max_model_len")
    return str(first["id"]), int(length) if isinstance(length, int) else None


def cells_within(cells: Sequence[tuple[int, int]], max_model_len: int | None) -> list[tuple[int, int]]:
    """The cells whose prompt and one output token fit the replica's context."""
    return [(c, n) for c, n in cells if max_model_len is None or c + n + 1 <= max_model_len]


def measure(url: str, model: str, cells: Sequence[tuple[int, int]], reps: int, seed: int = 0,
            vocab: tuple[int, int] = (4, 1000), timeout_s: float = 60.0) -> list[Reading]:
    """Each cell `reps` times, one request at a time, on the replica at `url` serving `model` (see the module's
    text). The reps go in rounds, each round every cell once: this machine's speed moves by half within minutes
    (docs/sim.md, "Where a long prompt's time goes"), and a cell measured all at once in a slow moment would bend
    the fit's split between tokens and pairs; in rounds, every cell's median is taken over the same moments."""
    rng = random.Random(seed)
    complete(url, model, [rng.randrange(*vocab) for _ in range(64)], timeout_s)  # the first request's warm-up
    times: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    hits: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for _ in range(reps):
        for cached, new in cells:
            prefix = [rng.randrange(*vocab) for _ in range(cached)]
            if cached:
                complete(url, model, prefix + [rng.randrange(*vocab)], timeout_s)
            before = counters([url], (*PREFILL, HITS))
            complete(url, model, prefix + [rng.randrange(*vocab) for _ in range(new)], timeout_s)
            after = counters([url], (*PREFILL, HITS))
            count = after[PREFILL[1]] - before[PREFILL[1]]
            if count != 1:
                raise RuntimeError(f"{url} prefilled {count:g} requests during one probe: is the replica idle?")
            times[cached, new].append((after[PREFILL[0]] - before[PREFILL[0]]) * 1e3)
            hits[cached, new].append(after[HITS] - before[HITS])
    readings = []
    for cached, new in cells:
        readings.append(Reading(cached, new, statistics.median(times[cached, new]),
                                statistics.median(hits[cached, new]), reps))
        print(f"cached {cached:5d} + new {new:5d}: prefill {readings[-1].prefill_ms:7.2f} ms "
              f"(hit {readings[-1].hit_tokens:.0f} tokens)", flush=True)
    return readings


class ShortContext(ValueError):
    """The replica's context holds fewer than the 3 cells a fit needs."""


def run(url: str, reps: int, seed: int = 0) -> tuple[list[Reading], Fit]:
    """The readings of every cell the replica at `url` can hold, and their fit."""
    model, max_model_len = served(url)
    cells = cells_within(CELLS, max_model_len)
    if len(cells) < 3:
        raise ShortContext(f"{url}'s context is too short for 3 cells of {CELLS}")
    readings = measure(url, model, cells, reps, seed)
    return readings, fit(readings)


def record(url: str, readings: Sequence[Reading], result: Fit) -> dict[str, Any]:
    """What `--out` writes (and `sim calibrate --prefill-cost` reads)."""
    return {"replica": url, "readings": [asdict(r) for r in readings], "fit": asdict(result)}


def idle_replica_parser(prog: str, doc: str, replica: str, out: str) -> argparse.ArgumentParser:
    """The command line of a probe of one idle replica (this one, `bench.burst_probe`): --replica, --reps, --seed,
    --out."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--replica", required=True, help=replica)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help=out)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = idle_replica_parser("python -m bench.prefill_cost", __doc__, "an idle vLLM replica's URL (prefix caching "
                                 "on)", "write the readings and the fit here (JSON)")
    args = parser.parse_args(argv)
    url = args.replica.rstrip("/")
    try:
        readings, result = run(url, args.reps, args.seed)
    except ShortContext as exc:
        parser.error(str(exc))
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        print(f"bench.prefill_cost: {url}: {exc}", file=sys.stderr)
        return 1
    print(f"fit: {result.base_s * 1e3:.2f} ms + {result.per_token_s * 1e6:.1f} us/token + "
          f"{result.per_pair_s * 1e9:.2f} ns/pair; errors " + ", ".join(f"{e:+.0%}" for e in result.errors))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record(args.replica, readings, result), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
