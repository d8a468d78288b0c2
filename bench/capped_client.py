"""What aiohttp's 100-connection default did to the stored GPU runs' closed loops, and the simulator without it.

Until 2026-11-30 `planner profile`, `planner validate` and their client processes opened `aiohttp.ClientSession()`,
whose connector holds at most 100 connections. A closed loop of B > 100 from one client process kept 100 requests
at the replica; the other B - 100 waited for a connection on the client, timed as part of their TTFT, and the
`/metrics` scrapes waited behind them (planner.client.load_session, which lifts the cap). Every GPU run so far
(docs/bench/gpu/, H200, 2026-11-26..29) was measured that way. This reads what they stored:

- per point of B > 100: by Little's law a request spent (B - 100) / throughput waiting for a connection, on
  average; beside it the mean TTFT measured, and the `/metrics` scrapes left unanswered;
- each frontier calibrated (`sim calibrate`, with the GPU's front-end latency) as stored, and with its points of
  B > 100 labelled as the 100 requests the replica had (the smallest such point kept, the others dropped: they too
  held 100);
- the replica counts of runs 3 and 4 as they held: one client process through the gateway kept 100 streams in
  all (one replica at 100, or two at 50 each: the same total), one client per replica 100 each (twice the
  streams with two). Beside them the simulator's counts, its steps priced by the H200's step-time constants
  fitted without the run's model (`sim stepfit`), and the one count no run has measured: one instance at 200.

    python -m bench.capped_client [--gpu docs/bench/gpu] [--out docs/bench/gpu/capped_client_2026-11-30.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.sources import point_path
from sim.fromprofile import EngineFacts, calibrate

from .common import markdown_table

POOL = 100  # aiohttp's TCPConnector(limit=100), the default of ClientSession()
FRONTIERS = {"qwen3-1.7b-2026-11-29": ("synthetic-qwen3-1.7b", 4096), "opt-1.3b": ("synthetic-opt-1.3b", 2048),
             "run2-2026-11-26/qwen3-1.7b": ("synthetic-qwen3-1.7b", 4096),
             "run3-2026-11-27/opt-1.3b": ("synthetic-opt-1.3b", 2048)}  # run: (served name, max_model_len)


def pool_rows(gpu: Path) -> list[dict[str, Any]]:
    """Every stored closed-loop point of B > POOL under `gpu`: its wait for a connection by Little's law beside
    its mean TTFT."""
    rows = []
    for path in sorted(gpu.glob("**/point-b*.json")):
        point = json.loads(path.read_text())["point"]
        batch, rate = int(point["batch_size"]), float(point["req_s"])
        if batch <= POOL or rate <= 0:
            continue
        wait_ms = 1e3 * (batch - POOL) / rate
        rows.append({"point": str(path.relative_to(gpu)), "batch_size": batch, "req_s": rate,
                     "ttft_mean_ms": point["ttft_ms"]["mean"], "ttft_p50_ms": point["ttft_ms"]["p50"],
                     "pool_wait_ms": wait_ms, "ttft_over_wait": point["ttft_ms"]["mean"] / wait_ms,
                     "metrics_missed": point.get("metrics_missed")})
    return rows


def batch_sizes(profile: Path) -> list[int]:
    """The batch sizes of a profile directory's point files, ascending."""
    return sorted(int(p.stem.removeprefix("point-b")) for p in profile.glob("point-b*.json"))


def relabelled(src: Path, dst: Path) -> list[int]:
    """A copy of the profile `src` at `dst` whose points of B > POOL are one point at B = POOL (the smallest of
    them); the batch sizes of the copy."""
    shutil.copytree(src, dst)
    over = [b for b in batch_sizes(dst) if b > POOL]
    for batch in over:
        path = point_path(dst, batch)
        data = json.loads(path.read_text())
        path.unlink()
        if batch == over[0]:
            data["point"]["batch_size"] = POOL
            point_path(dst, POOL).write_text(json.dumps(data))
    return batch_sizes(dst)


def calibration_rows(gpu: Path, runs: dict[str, tuple[str, int]]) -> list[dict[str, Any]]:
    """Each run's frontier calibrated as stored and relabelled: TTFT p50 and mean TPOT, real and simulated."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run, (name, length) in runs.items():
            src = gpu / run / "frontier"
            facts = EngineFacts(max_num_seqs=max(batch_sizes(src)), max_num_batched_tokens=8192, chunked_prefill=True,
                                prefix_caching=True, max_model_len=length, model_name=name)
            cost = gpu / run / "points" / "frontier" / "prefill_cost.json"
            for relabel in (False, True):
                profile = Path(tmp) / run.replace("/", "_") / str(relabel)
                if relabel:
                    relabelled(src, profile)
                else:
                    shutil.copytree(src, profile)
                _, fits = calibrate(profile, facts, prefill_cost=cost if cost.exists() else None,
                                    frontend_latency=True)
                rows += [{"run": run, "relabelled": relabel, "batch_size": f.batch_size,
                          "ttft_p50_ms": f.ttft_p50_ms, "sim_ttft_p50_ms": f.sim_ttft_p50_ms,
                          "tpot_mean_ms": f.tpot_mean_ms, "sim_tpot_mean_ms": f.sim_tpot_mean_ms} for f in fits]
    return rows


COUNTS = {"run3-2026-11-27/opt-1.3b": "opt-1.3b", "qwen3-1.7b-2026-11-29": "qwen3-1.7b"}  # steady counts, 3 ways
SIM_COUNTS = ((1, POOL), (2, POOL // 2), (2, POOL), (1, 2 * POOL))  # (replicas, streams each)


def steady(path: Path) -> float:
    """A stored count's tokens/s over its steady part (all its requests in flight), else over the whole run."""
    data = json.loads(path.read_text())
    return float(data.get("steady_tok_s") or data["total_tok_s"])


def measured_counts(run: Path) -> dict[str, float]:
    """A run's replica counts as they held: one client process through the gateway (100 streams in all, 1 or 2
    replicas), one client process per replica through the gateway and straight (100 streams each)."""
    counts = run / "points" / "replicas"
    return {f"{way} k{k}": steady(counts / f"{prefix}k{k}.json") for k in (1, 2)
            for way, prefix in (("one client", ""), ("k clients", "gateway-"), ("straight", "direct-"))}


def simulated_counts(model: str, input_tokens: int, output_tokens: int) -> dict[str, float]:
    """The simulator's tokens/s for `SIM_COUNTS` on the H200 (`bench.gpu.report.sim_tok_s`: 0.9 of its memory split
    between the replicas, every request at once, vLLM V1's chunked prefill), its steps priced by the H200's
    step-time constants fitted without `model`."""
    from bench.gpu.report import fit_without, sim_tok_s

    fit = fit_without(model, "H200")
    return {f"{k} x {streams}": sim_tok_s(fit, model, streams, k, input_tokens, output_tokens)
            for k, streams in SIM_COUNTS}


def count_rows(gpu: Path, runs: dict[str, str]) -> list[dict[str, Any]]:
    """Per run: the counts measured and simulated, in tokens/s."""
    rows = []
    for run, model in runs.items():
        settings = json.loads((gpu / run / "settings.json").read_text())
        rows.append({"run": run, "model": model, "measured": measured_counts(gpu / run),
                     "simulated": simulated_counts(model, settings["input_tokens"], settings["output_tokens"])})
    return rows


def counts_report(rows: Sequence[dict[str, Any]]) -> str:
    """Two replicas against one, measured as held and simulated: the same total of streams, and twice."""
    body = []
    for r in rows:
        m, s = r["measured"], r["simulated"]
        one = s[f"1 x {POOL}"]
        body.append([r["run"], f"{m['one client k2'] / m['one client k1'] - 1:+.0%}",
                     f"{s[f'2 x {POOL // 2}'] / one - 1:+.0%}",
                     f"{m['k clients k2'] / m['k clients k1'] - 1:+.0%}, {m['straight k2'] / m['straight k1'] - 1:+.0%}",
                     f"{s[f'2 x {POOL}'] / one - 1:+.0%}", f"{s[f'1 x {2 * POOL}'] / one - 1:+.0%}",
                     f"{m['one client k1']:,.0f}, {m['k clients k1']:,.0f}, {m['straight k1']:,.0f}",
                     f"{one:,.0f}"])
    return "\n".join([
        "Two replicas against one, as the counts held: 100 streams in all (one client process), and 100 each (one "
        "per replica: through the gateway, then straight). Simulated: the H200's step-time constants fitted without "
        "the run's model.", "",
        markdown_table(["run", "2 x 50 against 1 x 100, measured", "simulated", "2 x 100 against 1 x 100, measured",
                        "simulated", "1 x 200 against 1 x 100, simulated (not measured)",
                        "1 x 100 measured tok/s (three ways)", "simulated"], body), ""])


def report(pool: Sequence[dict[str, Any]], fits: Sequence[dict[str, Any]]) -> str:
    lines = ["Points of B > 100: (B - 100) / throughput is the mean wait for a connection by Little's law.", "",
             markdown_table(["point", "B", "req/s", "TTFT mean ms", "TTFT p50 ms", "(B - 100) / req/s ms",
                             "mean / wait", "scrapes unanswered"],
                            [[r["point"], r["batch_size"], f"{r['req_s']:.1f}", f"{r['ttft_mean_ms']:.0f}",
                              f"{r['ttft_p50_ms']:.0f}", f"{r['pool_wait_ms']:.0f}", f"{r['ttft_over_wait']:.2f}",
                              r["metrics_missed"]] for r in pool]), ""]
    body = [[r["run"], "B > 100 as 100" if r["relabelled"] else "as stored", r["batch_size"],
             f"{r['ttft_p50_ms']:.1f}", f"{r['sim_ttft_p50_ms']:.1f}",
             f"{r['sim_ttft_p50_ms'] / r['ttft_p50_ms'] - 1:+.0%}", f"{r['tpot_mean_ms']:.2f}",
             f"{r['sim_tpot_mean_ms']:.2f}", f"{r['sim_tpot_mean_ms'] / r['tpot_mean_ms'] - 1:+.0%}"] for r in fits]
    lines += ["Each frontier calibrated (`sim calibrate`, front-end latency) and its error at the points fitted:", "",
              markdown_table(["run", "frontier", "B", "TTFT p50 real", "sim", "error", "TPOT mean real", "sim",
                              "error"], body), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.capped_client", description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", type=Path, default=Path("docs/bench/gpu"), help="the stored GPU runs")
    parser.add_argument("--out", type=Path, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    if not args.gpu.is_dir():
        parser.error(f"--gpu {args.gpu}: no such folder")
    pool = pool_rows(args.gpu)
    runs = {run: v for run, v in FRONTIERS.items() if (args.gpu / run / "frontier").is_dir()}
    fits = calibration_rows(args.gpu, runs)
    counts = count_rows(args.gpu, {run: m for run, m in COUNTS.items() if (args.gpu / run / "points").is_dir()})
    print(report(pool, fits) + "\n" + counts_report(counts))
    if args.out:
        args.out.write_text(json.dumps({"pool": pool, "fits": fits, "counts": counts}, indent=1) + "\n")


if __name__ == "__main__":
    main()
