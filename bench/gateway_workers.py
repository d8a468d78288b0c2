"""Gateway worker processes side by side: requests/s, events/s and CPU per unit through 1, 2, ... N workers.

FAST fake replicas (bench/fast_replica.py, `--replicas` of them, so the replicas are not the ceiling) behind
`gateway serve --workers N` for each N in `--workers` (default 1,2), driven by wrk (`--wrk-threads`). Rounds
alternate the worker counts; medians are reported, with ratios to the first count:
  - non-streaming requests/s at saturation,
  - SSE events/s streaming 64 per response unpaced (several events per read),
  - SSE events/s paced 20 ms apart over 512 streams (one event per read, as vLLM streams),
  - the gateway's CPU (supervisor and workers together, from /proc) per request and per event: the cost of a
    unit must not rise with N (the shared load table is read at each pick, written at each event).
On a 2-core machine the load generator, the replicas and the workers share the cores, so throughput cannot
double; on a 16-core machine, `--workers 1,2,4,8 --replicas 4 --wrk-threads 4` gives the scaling curve.

    python -m bench.gateway_workers [--workers 1,2] [--rounds 3] [--seconds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from deploy.ports import free_ports

from .common import ROOT
from .gateway_overhead import process, wrk

CHUNKS = 64


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and all its descendants alive now (the supervisor and its workers)."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / 100.0  # clock ticks: 100 per second on Linux
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2", help="worker counts to compare (default 1,2)")
    parser.add_argument("--replicas", type=int, default=2, help="fast fake replicas (default 2)")
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("bench: wrk is needed (Debian/Ubuntu: apt-get install wrk)")
    counts = [int(n) for n in args.workers.split(",")]
    scenarios = {
        "non-streaming requests/s": ({"model": "fake-model", "prompt": "hello", "max_tokens": 16}, 64, 1),
        "events/s, 64 per stream, unpaced": ({"model": "fake-model", "prompt": "hello", "max_tokens": CHUNKS,
                                              "stream": True}, 64, CHUNKS),
        "events/s, paced 20 ms, 512 streams": ({"model": "fake-model", "prompt": "hello", "max_tokens": CHUNKS,
                                                "stream": True, "bench_itl_ms": 20}, 512, CHUNKS),
    }
    rate: dict[str, dict[int, list[float]]] = {name: {n: [] for n in counts} for name in scenarios}
    cpu: dict[str, dict[int, list[float]]] = {name: {n: [] for n in counts} for name in scenarios}
    with ExitStack() as stack:
        replicas = []
        for _ in range(args.replicas):
            port = free_ports()
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(process([sys.executable, "bench/fast_replica.py", "--port", str(port)],
                                        url + "/health"))
            replicas.append({"url": url, "max_requests": 100000, "max_outstanding_tokens": 10**9})
        gateways = {}
        for n in counts:
            port = free_ports()
            config = Path(tempfile.mkdtemp()) / "gateway.yaml"
            config.write_text(json.dumps({
                "replicas": replicas, "port": port, "host": "127.0.0.1", "workers": n, "log_level": "warning",
                "queue": {"max_size": 10000, "max_wait_s": 30}}))
            proc = stack.enter_context(process([sys.executable, "-m", "gateway.cli", "serve", "--config",
                                                str(config)], f"http://127.0.0.1:{port}/ready"))
            gateways[n] = (f"http://127.0.0.1:{port}", proc)
        for r in range(args.rounds):
            for name, (body, connections, per_response) in scenarios.items():
                for n, (url, proc) in gateways.items():
                    seconds = args.seconds * (3 if "paced" in name else 1)
                    cpu0 = tree_cpu_seconds(proc.pid)
                    result = wrk(url, body, connections, seconds, threads=args.wrk_threads)
                    if result.errors:
                        raise RuntimeError(f"{name} through {n} workers: {result.errors} errors")
                    rate[name][n].append(result.requests_per_s * per_response)
                    cpu[name][n].append((tree_cpu_seconds(proc.pid) - cpu0) / (result.requests * per_response))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = statistics.median
    base = counts[0]
    report: dict[str, object] = {"workers": counts, "replicas": args.replicas, "rounds": args.rounds}
    print(f"\nGateway workers, {args.replicas} fast fake replicas, medians of {args.rounds} rounds")
    print(f"{'':38}" + "".join(f"{f'{n} worker(s)':>22}" for n in counts))
    for name in scenarios:
        unit = "event" if "events" in name else "request"
        rates = {n: med(rate[name][n]) for n in counts}
        costs = {n: med(cpu[name][n]) * 1e6 for n in counts}
        print(f"{name:38}" + "".join(f"{rates[n]:12.0f} ({rates[n] / rates[base]:5.2f}x)" for n in counts))
        print(f"{'  CPU us per ' + unit:38}" + "".join(f"{costs[n]:12.1f} ({costs[n] / costs[base]:5.2f}x)"
                                                       for n in counts))
        report[name] = {"rate": rates, "rate_ratio": {n: rates[n] / rates[base] for n in counts},
                        f"cpu_us_per_{unit}": costs, "cpu_ratio": {n: costs[n] / costs[base] for n in counts}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
