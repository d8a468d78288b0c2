"""Where each policy sent its requests, rebuilt from the client's timings of a real run: did two policies route alike?

`bench.policy_verdict` compares policies by their tails. When two of them come out apart, the first question is
whether they chose differently at all. The gateway's choice is not in the records, but the client's timings are:
each request's send, first token, end and prompt length (`firsts`, `e2e_s`, `tpot_s` of a `bench.sim_vs_real` row),
and the replica it went to. From them, at each request's send, each replica's outstanding tokens as the gateway
counts them: a request in flight holds its prompt until its first token, then its output budget, counted down as
it streams (here linearly from the first token to the end; the output's length from the run's own TPOT). The
share of requests that went to the replica with the fewest outstanding tokens then says how much a policy follows
tokens: `least_outstanding_tokens` should be near 1, round robin near what chance gives. A simulated side's runs
(`sim serve` replicas behind the same gateway) are judged the same way, apart: whether the simulator routes as the
real side did.

Only requests that had a choice count: where the fewest was ahead of the next by `margin` tokens or more (a tie, or
a near one, is no choice). The client's view lags the gateway's by a network hop and the stream's buffering, so
even `least_outstanding_tokens` does not reach 1.

    python -m bench.route_choices docs/bench/runs_mix_gamma80_seeds62-73_2026-12-02.jsonl.gz [--margin 40]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import markdown_table
from .policy_verdict import read_rows
from .sim_vs_real_ranking import point_of


@dataclass(frozen=True)
class Flight:
    """One request as the client saw it: sent, first token and end (s from the run's start), prompt tokens,
    output tokens, the replica it went to."""

    sent: float
    first: float
    end: float
    prompt: int
    output: int
    replica: str

    def holds(self, t: float) -> float:
        """Outstanding tokens this request holds at `t`: none before its send or after its end, its prompt and
        output budget until its first token, then the output counted down to the end."""
        if t < self.sent or t >= self.end:
            return 0.0
        if t < self.first:
            return float(self.prompt + self.output)
        return self.output * (self.end - t) / (self.end - self.first)


def flights(row: dict[str, Any]) -> list[Flight] | None:
    """The run's requests as `Flight`s, in the order sent; None where the row cannot say (no `firsts`, a request
    without its replica, or `firsts`, `e2e_s` and `tpot_s` not one entry per request, as where a request streamed a
    single token)."""
    firsts, e2e, tpot = row.get("firsts"), row.get("e2e_s"), row.get("tpot_s")
    if not firsts or e2e is None or tpot is None or not len(firsts) == len(e2e) == len(tpot):
        return None
    if not all(f[3] for f in firsts):
        return None
    out = [Flight(sent, sent + ttft, sent + took, int(prompt), 1 + round((took - ttft) / step) if step > 0 else 1,
                  replica)
           for (sent, ttft, prompt, replica), took, step in zip(firsts, e2e, tpot)]
    return sorted(out, key=lambda f: f.sent)


def to_fewest(fl: Sequence[Flight], replicas: Sequence[str], margin: float) -> tuple[int, int]:
    """(requests sent to the replica with the fewest outstanding tokens, requests that had a choice: the fewest
    ahead of the next by `margin` tokens or more). `replicas`: every replica of the run (one idle throughout holds
    none)."""
    chose = had = 0
    for i, f in enumerate(fl):
        held = {r: 0.0 for r in replicas}
        for g in fl[:i]:
            held[g.replica] += g.holds(f.sent)
        ranked = sorted(held.items(), key=lambda kv: kv[1])
        if len(ranked) > 1 and ranked[1][1] - ranked[0][1] >= margin:
            had += 1
            chose += ranked[0][0] == f.replica
    return chose, had


@dataclass(frozen=True)
class Share:
    """One run's share of requests sent to the replica with the fewest outstanding tokens."""

    side: str
    point: str
    policy: str
    seed: int
    chose: int
    had: int

    @property
    def share(self) -> float:
        return self.chose / self.had if self.had else float("nan")


def shares(rows: Sequence[dict[str, Any]], margin: float = 40.0) -> list[Share]:
    """`to_fewest` of every single-turn run that can say (`flights`), real and simulated (a simulated side's runs go
    through the same gateway to `sim serve` replicas: whether the simulator routes as the real side did); the
    replicas of a run: those its side's runs sent to."""
    single = [r for r in rows if r["workload"] != "chat"]
    out = []
    for side in sorted({r["side"] for r in single}, key=lambda s: (s != "real", s)):
        runs = [r for r in single if r["side"] == side]
        replicas = sorted({f[3] for r in runs for f in (r.get("firsts") or []) if f[3]})
        for r in runs:
            fl = flights(r)
            if fl:
                out.append(Share(side, point_of(r), r["policy"], r["seed"], *to_fewest(fl, replicas, margin)))
    return out


def share_lines(found: Sequence[Share], margin: float) -> list[str]:
    """Per point, side and policy: the median share over the seeds, its range, the seeds and the requests that had
    a choice."""
    by: dict[tuple[str, str, str], list[Share]] = {}
    for s in found:
        if s.had:
            by.setdefault((s.point, s.side, s.policy), []).append(s)
    order = sorted(by, key=lambda k: (k[0], k[1] != "real", k[1], k[2]))
    body: list[list[object]] = []
    for key in order:
        values = [s.share for s in by[key]]
        body.append([*key, f"{np.median(values):.0%}", f"{min(values):.0%}-{max(values):.0%}", len(values),
                     sum(s.had for s in by[key])])
    return [f"Requests sent to the replica with the fewest outstanding tokens at their send, as the client's "
            f"timings rebuild them (where the fewest led by {margin:g} tokens or more):", "",
            markdown_table(["point", "side", "policy", "share (median over seeds)", "range", "seeds", "requests"],
                           body), ""]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="bench.sim_vs_real output directories, or the "
                        "runs.jsonl of one, gzipped or not (docs/bench/runs_*.jsonl.gz)")
    parser.add_argument("--margin", type=float, default=40.0, help="tokens the fewest must lead by for a request "
                        "to count as having had a choice (default 40)")
    args = parser.parse_args(argv)
    if args.margin < 0:
        parser.error("--margin must be 0 or more")
    found = []
    try:
        for d in args.dirs:
            found += shares(read_rows(d), args.margin)
    except FileNotFoundError as e:
        parser.error(str(e))
    if not any(s.had for s in found):
        parser.error("no single-turn run recorded each request's replica and timings (`firsts`)")
    print("\n".join(share_lines(found, args.margin)))


if __name__ == "__main__":
    main()
