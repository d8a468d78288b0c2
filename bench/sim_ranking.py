"""The simulator's ranking of the routing policies, held against the real side's where the real side can tell.

Issue 17 item 2 asks that the simulator rank the policies as real replicas do. On this 2-core VM no two real seeds
ranked all four policies alike (docs/sim.md), so a run's own ranking is noise; what the real side does tell, over
many seeds pooled (`bench.policy_verdict`), is the default's p99 TTFT over each other policy's with a 90% interval.
This bench gives the simulator the same question with as many seeds as wanted, in virtual time:

- the same schedules the real runs sent: `bench.sim_vs_real`'s workloads, built by the load generator's own
  code (`loadtest.config`, seeded arrivals and lengths), 12 s of Poisson arrivals (or bursts: `--arrivals
  poisson,gamma`) at 50/80/95% of capacity;
- capacity measured as the real side measured it: closed loop, 64 in flight, 320 requests;
- two replicas of a calibrated replica model (`sim calibrate --profile`) behind the gateway's own policy code,
  with deploy's gateway config (`max_num_seqs` requests a replica, then the admission queue) and the gateway's
  default speed, as `deploy up` configures a CPU deployment;
- each request keyed as the gateway keys a completions prompt (the first 1 KiB).

Then, per point and policy pair, the simulator's pooled ratio and its own 90% interval (whole seeds resampled,
`bench.policy_verdict.paired_ratios`) beside the real one: whether the two order the pair alike where the real
interval excludes 1 (the pairs the real side decides), and whether the simulator's ratio lies inside the real
interval everywhere.

    python -m bench.sim_ranking --replica-model docs/bench/sim_vs_real_replica_2026-11-28.json \\
        --real docs/bench/policy_verdict_8dirs_2026-11-27.md [--real-runs RUN_DIR] [--seeds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import QueueConfig
from loadtest.config import LoadConfig, config_from_options, make_parser
from loadtest.schedules import build_schedule
from loadtest.workloads import build_workload
from sim.clock import LoopClock
from sim.fleet import Gateway, Record, on_virtual_loop, run_routed, send
from sim.measured import ReplicaModel
from sim.node import MeasuredSpec, Node
from sim.workload import RequestSpec

from .common import markdown_table
from .policy_verdict import Ratio, paired_ratios
from .sim_vs_real import ARRIVALS, WORKLOADS, arrivals_option
from .sim_vs_real_report import DEFAULT, POLICIES, done_runs
from .sim_vs_real_ranking import point_of

LOADS = (0.5, 0.8, 0.95)
QUEUE = QueueConfig(max_size=1024, max_wait_s=60.0)


def load_config(workload: str, extra: Sequence[str]) -> LoadConfig:
    """The load generator's config for `bench.sim_vs_real`'s workload and these options, parsed by its parser."""
    opts = make_parser().parse_args(["--model", "m", *WORKLOADS[workload], *extra])
    return config_from_options(opts, ("http://unused",), None)


def requests(config: LoadConfig, n: int) -> list[RequestSpec]:
    """The first n requests' lengths, as the load generator draws them for this config's seed."""
    workload = build_workload(config.workload)
    return [RequestSpec(s.prompt_tokens, s.max_tokens) for s in (workload.request(i) for i in range(n))]


def schedule(workload: str, rate: float, duration: float, seed: int,
             arrival: str = "poisson") -> tuple[np.ndarray, list[RequestSpec]]:
    """Send times and lengths of the open-loop run `bench.sim_vs_real` sends at this point: `loadtest run` with the
    arrival process's options, `--rate R --duration D --seed S`."""
    config = load_config(workload, [*ARRIVALS[arrival], "--rate", f"{rate:.4f}", "--duration", f"{duration:g}",
                                    "--seed", str(seed)])
    arrivals = build_schedule(config.arrival)
    return arrivals, requests(config, len(arrivals))


def closed_loop_capacity(spec: MeasuredSpec, workload: str, concurrency: int = 64, n: int = 320,
                         given_speed: bool = False) -> float:
    """Requests/s in closed loop through the gateway (default policy), as `bench.sim_vs_real.capacity` measures
    the real side: `concurrency` clients, `n` requests, completed over the span from the first send to the last
    end."""
    specs = requests(load_config(workload, ["--mode", "closed", "--concurrency", str(concurrency),
                                            "--num-requests", str(n), "--prompt-salt", "999"]), n)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        gw = Gateway(Node(spec, LoopClock(loop)), DEFAULT, random.Random(0), spec.max_num_seqs, QUEUE,
                     given_speed=given_speed)
        queue = list(reversed(specs))
        records: list[Record] = []

        async def client() -> None:
            while queue:
                s = queue.pop()
                record = Record(loop.time(), s.prompt_tokens, s.output_tokens)
                records.append(record)
                await send(gw, record)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        end = max(r.finished for r in records if r.finished is not None)
        return sum(r.finished is not None for r in records) / end

    return on_virtual_loop(main())


def run(spec: MeasuredSpec, workload: str, load: float, seed: int, policy: str,
        sent: tuple[np.ndarray, list[RequestSpec]], given_speed: bool = False,
        arrival: str = "poisson") -> dict[str, Any]:
    """One run of the schedule `sent` (`schedule`'s) as a row of `bench.sim_vs_real`'s runs.jsonl (the fields
    `paired_ratios` and `tail` read)."""
    arrivals, specs = sent
    records: list[Record] = []
    run_routed(spec, specs, arrivals, policy, seed, spec.max_num_seqs, QUEUE, keys="completions", records_out=records,
               given_speed=given_speed)
    firsts = [[r.arrival, r.first_token - r.arrival, r.prompt_tokens, r.replica] for r in records
              if r.first_token is not None]
    return {"side": "sim-virtual", "workload": workload, "arrival": arrival, "load": load, "seed": seed,
            "policy": policy, "ttft_s": [f[1] for f in firsts], "firsts": firsts,
            "rejected": sum(r.rejected for r in records)}


RATIO = re.compile(r"([\d.]+) \(([\d.]+)-([\d.]+); (\d+)\)")


def read_real(path: Path) -> dict[str, dict[str, Ratio]]:
    """The interval table of a `bench.policy_verdict` report: point -> other policy -> the default's ratio."""
    header: list[str] = []
    out: dict[str, dict[str, Ratio]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "point" and len(cells) > 1 and all(" / " in c for c in cells[1:]):
            header = [c.split(" / ", 1)[1] for c in cells[1:]]
            continue
        for other, cell in zip(header, cells[1:]):
            if m := RATIO.fullmatch(cell):
                out.setdefault(cells[0], {})[other] = Ratio(float(m[1]), float(m[2]), float(m[3]), int(m[4]))
    if not out:
        raise ValueError(f"{path}: no interval table of bench.policy_verdict (cells like '1.02 (0.89-1.13; 15)')")
    return out


@dataclass(frozen=True)
class Pair:
    """One point and policy pair, both sides."""

    point: str
    other: str
    real: Ratio
    sim: Ratio

    @property
    def decided(self) -> bool:
        """The real side's interval excludes 1: it tells which of the two has the lower tail."""
        return self.real.low > 1 or self.real.high < 1

    @property
    def level(self) -> bool:
        """The simulator routed both policies' requests alike: the very same first tokens."""
        return self.sim.ratio == 1.0

    @property
    def alike(self) -> bool:
        """The simulator's pooled ratio is on the side of 1 the real one is."""
        return not self.level and (self.sim.ratio > 1) == (self.real.ratio > 1)

    @property
    def inside(self) -> bool:
        """The simulator's pooled ratio lies within the real 90% interval."""
        return self.real.low <= self.sim.ratio <= self.real.high


def pairs(real: dict[str, dict[str, Ratio]], sim: dict[str, dict[str, Ratio]]) -> list[Pair]:
    return [Pair(pt, other, r, sim[pt][other]) for pt, by in sorted(real.items()) for other, r in sorted(by.items())
            if other in sim.get(pt, {})]


def report(found: Sequence[Pair], meta: str) -> str:
    def cell(r: Ratio) -> str:
        return f"{r.ratio:.2f} ({r.low:.2f}-{r.high:.2f}; {r.seeds})"
    body = [[p.point, p.other, cell(p.real), cell(p.sim), "yes" if p.decided else "",
             "level" if p.level else "yes" if p.alike else "no", "yes" if p.inside else "no"] for p in found]
    decided = [p for p in found if p.decided]
    lines = [meta, "", f"The default ({DEFAULT})'s pooled p99 TTFT over each other policy's: ratio (90% interval; "
             "seeds).", "",
             markdown_table(["point", "other policy", "real", "simulated", "real decides", "ordered alike",
                             "simulated inside the real interval"], body), "",
             f"Pairs the real side decides (its interval excludes 1): {len(decided)}; the simulator orders "
             f"{sum(p.alike for p in decided)} of them alike, its ratio inside the real interval at "
             f"{sum(p.inside for p in decided)}.",
             f"All {len(found)} pairs: the simulator's ratio inside the real interval at "
             f"{sum(p.inside for p in found)}; ordered as the real pooled ratio at {sum(p.alike for p in found)}, "
             f"level (the very same first tokens) at {sum(p.level for p in found)} (a pair the real side does not "
             "decide is ordered by a coin).", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class Tail:
    """What the slowest 1% of first tokens were, pooled over a point's and policy's runs."""

    p99_ms: float
    long_share: float  # of the requests at or past the p99, those with a long prompt
    behind_long: float  # ... and of those long ones, the share sent while another long one was prefilling there


def tail(rows: Sequence[dict[str, Any]], long_tokens: int = 512) -> Tail:
    """`rows`' requests at or past their pooled p99 TTFT: how many had a long prompt, and how many of those went
    to a replica that had been sent another long prompt within a long prompt's median TTFT before (one long
    prefill behind another)."""
    firsts = [(k, *f) for k, r in enumerate(rows) for f in r["firsts"]]
    ttft = np.array([f[2] for f in firsts])
    longs = [f for f in firsts if f[3] > long_tokens]
    window = float(np.median([f[2] for f in longs])) if longs else 0.0
    sent: dict[tuple[int, Any], list[float]] = {}
    for k, at, _, _, replica in longs:
        sent.setdefault((k, replica), []).append(at)
    p99 = float(np.percentile(ttft, 99))
    top = [f for f in firsts if f[2] >= p99]
    top_long = [f for f in top if f[3] > long_tokens]
    behind = [f for f in top_long if any(f[1] - window <= t < f[1] for t in sent[(f[0], f[4])])]
    return Tail(p99 * 1e3, len(top_long) / len(top), len(behind) / len(top_long) if top_long else float("nan"))


def tail_lines(sides: dict[str, Sequence[dict[str, Any]]]) -> list[str]:
    """Per point and policy, each side's `tail`."""
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for side, rows in sides.items():
        for r in rows:
            if r.get("firsts"):
                groups.setdefault((point_of(r), r["policy"]), {}).setdefault(side, []).append(r)
    names = list(sides)
    body = []
    for (pt, policy), by in sorted(groups.items()):
        cells = []
        for side in names:
            t = tail(by[side]) if side in by else None
            cells += [f"{t.p99_ms:.0f}", f"{t.long_share:.0%}", f"{t.behind_long:.0%}"] if t else ["", "", ""]
        body.append([pt, policy, *cells])
    head = [h for side in names for h in (f"p99 ms, {side}", "long in the top 1%", "of which behind a long")]
    return ["Where the slowest 1% of first tokens came from: the share with a long prompt, and of those the share "
            "sent to a replica that had been sent another long prompt within a long prompt's median TTFT before.",
            "", markdown_table(["point", "policy", *head], body), ""]


def p99_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The simulated side's pooled p99 TTFT per point and policy."""
    by: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        by.setdefault(point_of(r), {}).setdefault(r["policy"], []).extend(r["ttft_s"])
    body = [[pt, *(f"{np.percentile(v[p], 99) * 1e3:.0f}" if p in v else "" for p in POLICIES)]
            for pt, v in sorted(by.items())]
    return ["Simulated p99 TTFT, ms, pooled over the seeds:", "", markdown_table(["point", *POLICIES], body), ""]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_ranking", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica-model", required=True, type=Path, help="a `sim calibrate --profile` JSON")
    parser.add_argument("--real", required=True, type=Path, help="a `bench.policy_verdict` report (markdown)")
    parser.add_argument("--real-runs", nargs="*", type=Path, default=[],
                        help="bench.sim_vs_real directories whose real runs recorded each request (`firsts`): "
                             "their tails' make-up beside the simulator's")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of schedule per run (12)")
    parser.add_argument("--workloads", default="mix,sharegpt")
    parser.add_argument("--arrivals", type=arrivals_option, default="poisson",
                        help="poisson,gamma (gamma: burstiness 0.25, CV 2, as bench.sim_vs_real sends it)")
    parser.add_argument("--given-speed", action="store_true",
                        help="give the gateway the replica model's speed (as a plan would), not its defaults")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    try:
        real = read_real(args.real)
        spec = MeasuredSpec(ReplicaModel.load(str(args.replica_model)), args.replicas)
        real_rows = [r for d in args.real_runs for r in done_runs(d / "runs.jsonl").values()
                     if r["side"] == "real" and r.get("firsts")]
    except (OSError, ValueError) as e:
        parser.error(str(e))
    rows = []
    caps = {}
    for workload in args.workloads.split(","):
        caps[workload] = closed_loop_capacity(spec, workload, given_speed=args.given_speed)
        for arrival in args.arrivals:
            for load in LOADS:
                for seed in range(args.seeds):
                    sent = schedule(workload, load * caps[workload], args.duration, seed, arrival)  # every policy's
                    rows += [run(spec, workload, load, seed, p, sent, args.given_speed, arrival) for p in POLICIES]
    rejected = sum(r["rejected"] for r in rows)
    meta = (f"Simulated: {args.replica_model}, {args.replicas} replicas, the gateway's "
            f"{'speed from the model' if args.given_speed else 'default speed'}, {args.seeds} seeds x "
            f"{args.duration:g} s a run, {len(rows)} runs in virtual time, {rejected} requests rejected; closed-loop "
            "capacity " + ", ".join(f"{w} {c:.2f} requests/s" for w, c in caps.items()) + f". Real: {args.real}.")
    text = "\n".join([report(pairs(real, paired_ratios([rows])), meta), *p99_lines(rows),
                      *tail_lines({"real": real_rows, "simulated": rows} if real_rows else {"simulated": rows})])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
