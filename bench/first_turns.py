"""Where a chat's first turn should go: prefix_affinity's FIRST_TURN_WEIGHT against the cost to single-turn chat.

On replicas imitating a profiled real one (`sim calibrate --profile`; two by default), in virtual time through the
gateway's own policy code:

- multi-turn: 60 chats starting as a Poisson process at 2, 4 and 8 conversations/s (so they run concurrently),
  4-6 turns, a shared 128-token system prompt, 300-token messages, 64-token replies, 1 s think time; prefix-cache
  hit rate against the sticky oracle (each chat pinned where its first turn went);
- single-turn chat traffic (every request a first turn with its own key): 80% 128 + 32 tokens, 20% 1,024 + 256,
  Poisson at 50/80/95% of capacity; p99 TTFT against `estimated_ttft`'s.

Each figure pools 3 seeds.

    python -m bench.first_turns --replica-model runs/sim_vs_real/replica.json [--weights 0,0.2,0.5,1]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from gateway.policies import PrefixAffinity, make_policy
from sim.fleet import Pinned, Record, capacity, run_conversations, run_routed, saturation_sample
from sim.measured import ReplicaModel
from sim.node import MeasuredSpec
from sim.workload import RequestSpec, conversations, poisson_arrivals

from .common import markdown_table

SEEDS = 3


def mix(n: int, rng: np.random.Generator) -> list[RequestSpec]:
    return [RequestSpec(1024, 256) if rng.random() < 0.2 else RequestSpec(128, 32) for _ in range(n)]


class Weighted(PrefixAffinity):
    """prefix_affinity with another FIRST_TURN_WEIGHT (0: a first turn by load, its first choice only on a tie)."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.FIRST_TURN_WEIGHT = weight


def chat_hit_rate(spec: MeasuredSpec, policy: object, rate: float) -> float:
    hits = []
    for seed in range(SEEDS):
        convs = conversations(60, rate, np.random.default_rng(seed), system_tokens=128, turns=(4, 6),
                              user_mean=300.0, output_mean=64.0, think_mean_s=1.0)
        hits.append(run_conversations(spec, convs, policy, seed).hit_rate)  # type: ignore[arg-type]
    return float(np.mean(hits))


def single_turn_p99(spec: MeasuredSpec, policy: object, load: float, rate: float) -> float:
    ttfts: list[float] = []
    for seed in range(SEEDS):
        out: list[Record] = []
        run_routed(spec, mix(600, np.random.default_rng(seed)), poisson_arrivals(
            600, load * rate, np.random.default_rng(seed + 100)), policy, seed, keys="chat",  # type: ignore[arg-type]
            records_out=out)
        ttfts += [r.first_token - r.arrival for r in out if r.first_token is not None]
    return float(np.percentile(ttfts, 99)) * 1e3


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.first_turns", description=__doc__.split("\n")[0])
    parser.add_argument("--replica-model", required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--weights", default="0,0.2,0.5,1")
    args = parser.parse_args(argv)
    spec = MeasuredSpec(ReplicaModel.load(args.replica_model), args.replicas)
    weights = [float(w) for w in args.weights.split(",")]
    rates, loads = (2.0, 4.0, 8.0), (0.5, 0.8, 0.95)
    oracle = {r: chat_hit_rate(spec, Pinned(make_policy("estimated_ttft")), r) for r in rates}
    cap = capacity(spec, saturation_sample(spec, mix(2000, np.random.default_rng(0))))
    base = {load: single_turn_p99(spec, "estimated_ttft", load, cap) for load in loads}
    rows = []
    for w in weights:
        hits = [chat_hit_rate(spec, Weighted(w), r) for r in rates]
        p99 = [single_turn_p99(spec, Weighted(w), load, cap) for load in loads]
        rows.append([f"{w:g}", *(f"{h:.1%} ({(h - oracle[r]) * 100:+.1f})" for h, r in zip(hits, rates)),
                     *(f"{p:.0f} ms ({p / base[load]:.2f} x)" for p, load in zip(p99, loads))])
    rows.append(["oracle / estimated_ttft", *(f"{oracle[r]:.1%}" for r in rates),
                 *(f"{base[load]:.0f} ms" for load in loads)])
    print(markdown_table(["FIRST_TURN_WEIGHT", *(f"chat hit rate, {r:g}/s (vs oracle)" for r in rates),
                          *(f"single-turn chat p99 TTFT, {load:.0%}" for load in loads)], rows))


if __name__ == "__main__":
    main()
