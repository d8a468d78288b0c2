"""How fast the replicas' engines step right now: a short fixed load, read from vLLM's own counters.

Every replica at once gets `batch` clients sending the same fixed request (token-id prompts of random ids, so no
prefix-cache hit; `ignore_eos`) one after another for `seconds`. The reading is each replica's mean step over that
span: span x replicas / steps, steps being the count of vLLM's `vllm:iteration_tokens_total` (`sim serve` counts
the same). With the load fixed, two readings differ only by how fast the machine runs the engines then: on this
2-core VM, the same probe by hand (B = 4, 132 + 153 tokens) read 5.1-5.3 ms a step in one minute and 6.6-6.7 ms
five minutes later, replicas restarted or not (docs/sim.md). `bench.sim_vs_real --follow-speed` takes one after
the calibration and one before each real run, and runs the matching simulated run that many times slower or
faster.

    python -m bench.engine_speed --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 --seconds 15 --times 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp

STEPS = "vllm:iteration_tokens_total_count"
SAMPLED = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class Reading:
    """One reading: a replica's mean step in ms, and what the steps held (tokens sampled a step)."""

    ms_a_step: float
    sampled_a_step: float
    steps: float
    requests: int


def counters(urls: Sequence[str], names: Sequence[str], timeout_s: float = 5.0) -> dict[str, float]:
    """vLLM's samples of these names from each replica's /metrics, summed over the replicas (and over the label
    sets of each)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    return totals


async def _client(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random, prompt: int,
                  output: int, until: float) -> int:
    done = 0
    while time.monotonic() < until:
        body = {"model": model, "prompt": [rng.randrange(10, 1000) for _ in range(prompt)], "max_tokens": output,
                "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: {resp.status} {(await resp.text())[:300]}")
            await resp.read()
        done += 1
    return done


async def read(urls: Sequence[str], seconds: float = 8.0, batch: int = 4, prompt: int = 256, output: int = 64,
               seed: int = 0, timeout_s: float = 120.0) -> Reading:
    """One reading over `urls` at once (see the module's docstring)."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        models = []
        for url in urls:
            async with session.get(url + "/v1/models") as resp:
                models.append((await resp.json())["data"][0]["id"])
        before = counters(urls, (STEPS, SAMPLED))
        start = time.monotonic()
        counts = await asyncio.gather(*(_client(session, u, m, random.Random(rng.random()), prompt, output,
                                                start + seconds)
                                        for u, m in zip(urls, models) for _ in range(batch)))
        span = time.monotonic() - start
        after = counters(urls, (STEPS, SAMPLED))
    steps, sampled = after[STEPS] - before[STEPS], after[SAMPLED] - before[SAMPLED]
    if not steps:
        raise RuntimeError("the replicas counted no step: no vllm:iteration_tokens_total in their /metrics?")
    return Reading(1000 * span * len(urls) / steps, sampled / steps, steps, sum(counts))


def read_sync(urls: Sequence[str], seconds: float = 8.0, seed: int = 0) -> Reading:
    return asyncio.run(read(urls, seconds, seed=seed))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", required=True, help="comma-separated replica URLs (vLLM or sim serve)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--times", type=int, default=1, help="readings, one after another")
    args = parser.parse_args(argv)
    urls = [u.rstrip("/") for u in args.replicas.split(",") if u]
    for k in range(args.times):
        print(json.dumps(asdict(read_sync(urls, args.seconds, seed=k))), flush=True)


if __name__ == "__main__":
    main()
