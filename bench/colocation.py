"""Do co-located replicas slow each other? One replica profiled alone, then two profiled at once, interleaved.

On vLLM-CPU each replica is pinned to its own core, so the simulator treats them as independent
(`shared_device` false); on a GPU they time-share one device. If two busy CPU replicas still slow each other (the
memory bus and the last-level cache are shared), the simulator, calibrated from one replica profiled alone, is
optimistic whenever both are busy, as `bench.sim_vs_real` found. This measures it: `planner profile --url` on the
first replica alone, then on both at once (same batch sizes and workload), `--repeats` times in alternation,
and reports per batch size the median ratio of TPOT and TTFT p50 with a neighbour busy to alone.

    python -m bench.colocation --deployment RUN_DIR [--repeats 3] [--batch-sizes 1,4,16,32] [--out DIR]

RUN_DIR is a running `deploy up --replicas 2` (its state.json names the replicas).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKLOAD = ["--input-tokens", "256", "--output-tokens", "64"]


def profile(urls: list[str], out: Path, batch_sizes: str, requests: int) -> None:
    """`planner profile` on each URL at the same time, into out/<i>."""
    procs = [subprocess.Popen([sys.executable, "-m", "planner.cli", "profile", "--url", url, "--out",
                               str(out / str(i)), "--batch-sizes", batch_sizes, "--num-requests", str(requests),
                               *WORKLOAD], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i, url in enumerate(urls)]
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"planner profile failed: {err.decode()[-2000:]}")


def figures(directory: Path) -> dict[int, dict[str, float]]:
    points = {}
    for path in sorted(directory.glob("point-b*.json")):
        point = json.loads(path.read_text())["point"]
        points[point["batch_size"]] = {"tpot": point["tpot_ms"]["mean"], "ttft": point["ttft_ms"]["p50"]}
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployment", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,4,16,32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/colocation"))
    args = parser.parse_args()
    urls = [r["url"] for r in json.loads((args.deployment / "state.json").read_text())["replicas"]][:2]
    ratios: dict[int, dict[str, list[float]]] = {}
    for r in range(args.repeats):
        alone, together = args.out / f"alone-{r}", args.out / f"together-{r}"
        profile(urls[:1], alone, args.batch_sizes, args.num_requests)
        profile(urls, together, args.batch_sizes, args.num_requests)
        a, t = figures(alone / "0"), figures(together / "0")
        for b in a:
            for metric in ("tpot", "ttft"):
                ratios.setdefault(b, {}).setdefault(metric, []).append(t[b][metric] / a[b][metric])
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    result: dict[str, Any] = {}
    print(f"replica 0 with replica 1 equally busy, against alone: medians of {args.repeats} alternations")
    print(f"{'B':>4} {'TPOT x':>8} {'TTFT p50 x':>11}   (each repeat's TPOT ratio)")
    for b, by in sorted(ratios.items()):
        tpot, ttft = statistics.median(by["tpot"]), statistics.median(by["ttft"])
        print(f"{b:4d} {tpot:8.3f} {ttft:11.3f}   {' '.join(f'{x:.3f}' for x in by['tpot'])}")
        result[str(b)] = {"tpot_ratio": tpot, "ttft_ratio": ttft, "tpot_ratios": by["tpot"],
                          "ttft_ratios": by["ttft"]}
    (args.out / "colocation.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
