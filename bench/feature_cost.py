"""What the optional features cost the gateway: everything off, and each feature on, side by side.

One gateway per variant (the same config but the feature's section) in front of one fast FAKE replica; tracing's
spans go to a local sink that accepts OTLP/HTTP and throws it away (a real collector would run elsewhere). Each
round sends the same open-loop schedule of non-streaming requests (and of 64-chunk streams) to each gateway in turn;
the figures are the gateway process's CPU time per request (from /proc) and the client's p50 latency, medians over
rounds, with ratios to "off".

    python -m bench.feature_cost [--rounds 5] [--seconds 10] [--rate 100] [--baseline REV] [--save]

--baseline REV adds the gateway as it was at git revision REV (e.g. before a feature), from a temporary worktree:
"off" against it is what the features' code costs when they are off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.common import markdown_table, save, worktree
from bench.gateway_overhead import cpu_seconds, fixed_rate, pct, process, wait_ready
from deploy.ports import free_ports

# name -> the config sections that turn the feature on (SINK: the span sink's URL)
SINK = "<sink>"
VARIANTS: dict[str, dict[str, Any]] = {
    "off": {},
    "tracing, ratio 0.01": {"tracing": {"endpoint": SINK, "sampling_ratio": 0.01}},
    "tracing, ratio 1.0": {"tracing": {"endpoint": SINK, "sampling_ratio": 1.0}},
    "priority and fairness on": {"priority": {"enabled": True}, "tenants": {"fair": True}},
    "a LoRA adapter registered": {"lora": {"adapters": {"a0": "/adapters/a0"}}},  # requests name the base model
}


@contextmanager
def baseline_gateway(rev: str, config: Path, url: str) -> Iterator[subprocess.Popen[bytes]]:
    """The gateway at git revision `rev`, from a temporary worktree, serving `config`."""
    with worktree(rev) as tree:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=tree,
                                env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_ready(url + "/ready")
            yield proc
        finally:
            proc.terminate()
            proc.wait(10)


@contextmanager
def span_sink() -> Iterator[tuple[str, list[int]]]:
    """An OTLP/HTTP endpoint that answers 200 to every export; yields its URL and the bytes it received."""
    received = [0]

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            received[0] += len(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", received
    finally:
        server.shutdown()
        server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rate", type=float, default=100, help="requests/s of each schedule (100)")
    parser.add_argument("--baseline", metavar="REV", help="also the gateway at this git revision (tracing off)")
    parser.add_argument("--save", action="store_true", help="write docs/bench/feature_cost.{json,md}")
    args = parser.parse_args()
    variants = dict(VARIANTS)
    if args.baseline:
        variants = {f"before ({args.baseline})": {}, **variants}
    replica_port = free_ports()
    replica = f"http://127.0.0.1:{replica_port}"
    workdir = Path(tempfile.mkdtemp())
    cpu: dict[tuple[str, str], list[float]] = {}
    p50: dict[tuple[str, str], list[float]] = {}
    with ExitStack() as stack:
        sink_url, received = stack.enter_context(span_sink())
        stack.enter_context(process([sys.executable, "bench/fast_replica.py", "--port", str(replica_port)],
                                    replica + "/health"))
        gateways: dict[str, tuple[str, int]] = {}
        for name, sections in variants.items():
            port = free_ports()
            config = {"replicas": [{"url": replica, "max_requests": 100000, "max_outstanding_tokens": 10**9}],
                      "port": port, "host": "127.0.0.1", "log_level": "warning",
                      **json.loads(json.dumps(sections).replace(SINK, sink_url))}
            path = workdir / f"gateway-{len(gateways)}.yaml"
            path.write_text(json.dumps(config))
            url = f"http://127.0.0.1:{port}"
            if name.startswith("before"):
                proc = stack.enter_context(baseline_gateway(args.baseline, path, url))
            else:
                proc = stack.enter_context(process([sys.executable, "-m", "gateway.cli", "serve", "--config",
                                                    str(path)], url + "/ready"))
            gateways[name] = (url, proc.pid)
        for r in range(args.rounds):
            for kind, stream in (("request", False), ("stream of 64 chunks", True)):
                order = list(gateways.items())
                if r % 2:
                    order.reverse()  # neither variant always goes first
                for name, (url, pid) in order:
                    cpu0 = cpu_seconds(pid)
                    body: dict[str, object] = {"model": "fake-model", "prompt": "hello",
                                               "max_tokens": 64 if stream else 16, "stream": stream}
                    lat = asyncio.run(fixed_rate(url, args.rate / 4 if stream else args.rate, args.seconds, body))
                    time.sleep(0.5)  # the batch exporter's thread finishes its share of the work
                    cpu.setdefault((kind, name), []).append((cpu_seconds(pid) - cpu0) / len(lat))
                    p50.setdefault((kind, name), []).append(pct(lat, 50))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = statistics.median
    report: dict[str, Any] = {"rounds": args.rounds, "seconds": args.seconds, "rate": args.rate,
                              "span_bytes_exported": received[0]}
    rows = []
    for kind in ("request", "stream of 64 chunks"):
        base_cpu, base_p50 = med(cpu[(kind, "off")]), med(p50[(kind, "off")])
        for name in variants:
            c, p = med(cpu[(kind, name)]), med(p50[(kind, name)])
            rows.append([kind, name, f"{c * 1e6:.0f}", f"{c / base_cpu:.2f}", f"{p * 1e3:.2f}", f"{p / base_p50:.2f}"])
            report[f"{kind} / {name}"] = {"cpu_us": c * 1e6, "cpu_ratio": c / base_cpu, "p50_ms": p * 1e3,
                                          "p50_ratio": p / base_p50,
                                          "cpu_us_rounds": [x * 1e6 for x in cpu[(kind, name)]]}
    command = " ".join(["python -m bench.feature_cost", *sys.argv[1:]])
    text = "\n".join([
        "# What the optional features cost the gateway", "",
        f"`{command}`: one fast fake replica, medians of {args.rounds} interleaved rounds of {args.seconds:g} s at "
        f"{args.rate:g} requests/s (streams of 64 chunks at a quarter of that); CPU is the gateway process's per "
        "request, p50 the client's.", "",
        markdown_table(["per", "variant", "gateway CPU us", "x off", "p50 ms", "x off"], rows)])
    print(text)
    if args.save:
        save("feature_cost", report, text)


if __name__ == "__main__":
    main()
