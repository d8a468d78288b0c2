"""The headroom's flood test at a fresh gateway (gateway/askrates.py), with its first-request reading swept.

At a cold start every tenant is new. Three light tenants at 5 requests/s each (Poisson, 40-120 tokens a request)
start together; the test asks, at each request, whether its kind outpaces the others 4 x (`ALONE_X` x `FLOOD_X`,
held with nothing queued; at least its second request). Counted over 2 s of arrivals:

- light tenants held: the cold starts (of `--trials`) in which any light request read as a flood;
- a flood at 50 requests/s starting with them: its request from which it reads as one (median, 90th percentile).

Rows: each kind's first request read as is (before 2026-11-28), and over the band's age with each floor in
`--floors` (`AskRates.first_age_s`; 0.25 s is the gateway's).

    python -m bench.cold_start_asks [--trials 300] [--floors 0.1,0.2,0.25,0.3,0.5]
"""

from __future__ import annotations

import argparse

import numpy as np

from gateway.askrates import AskRates
from gateway.fairqueue import PriorityOrder

LIGHT_RATE, LIGHTS, FLOOD_RATE, SECONDS, TOKENS = 5.0, 3, 50.0, 2.0, (40.0, 120.0)
BOUND, ASKS = PriorityOrder.FLOOD_X * PriorityOrder.ALONE_X, PriorityOrder.FLOOD_ASKS  # with nothing queued


def arrivals(seed: int, flood: bool) -> list[tuple[float, str, float]]:
    """(time, tenant, tokens) of the light tenants, and of the flood if `flood`, in time order."""
    rng = np.random.default_rng(seed)
    rates = [(f"light{k}", LIGHT_RATE) for k in range(LIGHTS)] + ([("flood", FLOOD_RATE)] if flood else [])
    out = []
    for tenant, rate in rates:
        at = rng.exponential(1 / rate)
        while at < SECONDS:
            out.append((at, tenant, float(rng.uniform(*TOKENS))))
            at += rng.exponential(1 / rate)
    return sorted(out)


def rates(first_age_s: float | None) -> AskRates:
    """The gateway's counts; `first_age_s` None: a first request read as is."""
    return AskRates(tau_s=PriorityOrder.ASK_TAU_S, keep_s=10.0, max_bands=64,  # keep_s: headroom_idle_s's default
                    first_age_s=float("inf") if first_age_s is None else first_age_s)  # 1 - exp(-inf) = 1: as is


def lights_held(first_age_s: float | None, seed: int) -> bool:
    asks = rates(first_age_s)
    held = False
    for at, tenant, tokens in arrivals(seed, flood=False):
        asks.ask((tenant, 0), at, tokens)
        held |= asks.outpaces((tenant, 0), at + 0.001, BOUND, ASKS)
    return held


def flood_held_from(first_age_s: float | None, seed: int) -> int | None:
    asks, n = rates(first_age_s), 0
    for at, tenant, tokens in arrivals(seed, flood=True):
        asks.ask((tenant, 0), at, tokens)
        if tenant == "flood":
            n += 1
            if asks.outpaces((tenant, 0), at + 0.001, BOUND, ASKS):
                return n
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--floors", default="0.1,0.2,0.25,0.3,0.5")
    args = parser.parse_args()
    print("| first request read | cold starts with a light tenant held | flood held from its request: median | p90 |")
    print("|---|---:|---:|---:|")
    for floor in [None, *(float(f) for f in args.floors.split(","))]:
        held = sum(lights_held(floor, s) for s in range(args.trials))
        froms = [n for n in (flood_held_from(floor, s) for s in range(args.trials)) if n is not None]
        name = "as is" if floor is None else f"over the band's age, at least {floor:g} s"
        print(f"| {name} | {held} of {args.trials} | {np.median(froms):g} | {np.percentile(froms, 90):.0f} |"
              + ("" if len(froms) == args.trials else f" (never held in {args.trials - len(froms)})"))


if __name__ == "__main__":
    main()
