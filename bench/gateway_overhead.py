"""Direct-to-replica against through-the-gateway, side by side in one run, with a fast FAKE replica.

A bare aiohttp proxy (bench/bare_proxy.py: no parsing, accounting, health checks or metrics) runs beside them as
a reference: it shows what any aiohttp-based proxy costs on the same machine in the same run.

Measures, for each path, in rounds that alternate direct and gateway (medians reported):
  - requests/s at saturation, non-streaming (wrk),
  - SSE chunks/s streaming 64 chunks per response, unpaced and paced like real tokens (wrk; every response is
    complete, so chunks = responses x 64),
  - p50/p99 latency at a fixed 100 requests/s, open-loop (Python client; the gateway's figure minus direct's is
    what the gateway adds),
  - the gateway's CPU time per request and per chunk (from /proc).
The gateway runs with everything on: the default routing (prefix_affinity), token accounting, admission caps,
health probes, metrics.

    python bench/gateway_overhead.py [--rounds 3] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from deploy.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
CHUNKS = 64
PACED_ITL_MS = 20


def wait_ready(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(["curl", "-sf", "-o", "/dev/null", url], timeout=2)
            if out.returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready in {timeout_s} s")


@contextmanager
def process(args: list[str], ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(ready_url)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, all its threads, in nanoseconds' resolution (schedstat; /proc/PID/stat's clock
    ticks of 10 ms would round a 10 s run of 1,000 requests to 10 us a request)."""
    try:
        return sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir()
                   ) / 1e9
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended between the listing and the read
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class WrkResult:
    requests_per_s: float
    requests: int
    errors: int


def wrk(url: str, body: dict[str, object], connections: int, seconds: float, threads: int = 1,
        auth: str | None = None, cores: list[int] | None = None) -> WrkResult:
    """wrk POSTing `body` to url/v1/completions (with `auth` as a Bearer key; pinned to `cores` with taskset)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(f'wrk.method = "POST"\nwrk.body = {json.dumps(json.dumps(body))}\n'
                     'wrk.headers["Content-Type"] = "application/json"\n'
                     + (f'wrk.headers["Authorization"] = "Bearer {auth}"\n' if auth else ""))
    pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
    try:
        out = subprocess.run([*pin, "wrk", f"-t{threads}", f"-c{connections}", f"-d{int(seconds)}s", "--timeout", "30s", "-s", script.name,
                              url + "/v1/completions"], capture_output=True, text=True, timeout=seconds + 30).stdout
    finally:
        os.unlink(script.name)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    n_errors = int(errors.group(1)) if errors else 0
    if socket_errors:
        n_errors += sum(int(g) for g in socket_errors.groups())
    return WrkResult(rps, total, n_errors)


async def fixed_rate(url: str, rate: float, seconds: float, body: dict[str, object] | None = None,
                     headers: dict[str, str] | None = None) -> list[float]:
    """Latencies (s, to the answer's last byte) of requests sent open-loop at `rate` per second: `body` (default a
    16-token non-streaming completion) POSTed to url/v1/completions with `headers`."""
    payload = json.dumps(body or {"model": "fake-model", "prompt": "hello", "max_tokens": 16}).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            start = loop.time()
            async with session.post(url + "/v1/completions", data=payload, headers=sent) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status}")
            latencies.append(loop.time() - start)

        for _ in range(20):  # warm the connection pool
            await one()
        latencies.clear()
        tasks = []
        t0 = loop.time()
        for i in range(int(rate * seconds)):
            delay = t0 + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("bench: wrk is needed (Debian/Ubuntu: apt-get install wrk)")

    replica_port, gateway_port, bare_port = free_ports(), free_ports(), free_ports()
    direct, through = f"http://127.0.0.1:{replica_port}", f"http://127.0.0.1:{gateway_port}"
    bare = f"http://127.0.0.1:{bare_port}"
    paths = (("direct", direct), ("bare", bare), ("gateway", through))
    config = Path(tempfile.mkdtemp()) / "gateway.yaml"
    config.write_text(json.dumps({
        "replicas": [{"url": direct, "max_requests": 100000, "max_outstanding_tokens": 10**9}],
        "port": gateway_port, "host": "127.0.0.1", "policy": "prefix_affinity",
        "queue": {"max_size": 10000, "max_wait_s": 30}, "log_level": "warning"}))
    scenarios = {
        "non-streaming requests/s": ({"model": "fake-model", "prompt": "hello", "max_tokens": 16}, 32, 1),
        "streaming chunks/s, unpaced": ({"model": "fake-model", "prompt": "hello", "max_tokens": CHUNKS,
                                         "stream": True}, 32, CHUNKS),
        f"streaming chunks/s, paced {PACED_ITL_MS} ms": ({"model": "fake-model", "prompt": "hello",
                                                        "max_tokens": CHUNKS, "stream": True,
                                                        "bench_itl_ms": PACED_ITL_MS}, 512, CHUNKS),
    }
    results: dict[str, dict[str, list[float]]] = {name: {"direct": [], "bare": [], "gateway": [], "cpu": []}
                                                  for name in scenarios}
    latency: dict[str, dict[str, list[float]]] = {path: {"p50": [], "p99": []} for path, _ in paths}
    cpu_per_request: list[float] = []
    with process([sys.executable, "bench/fast_replica.py", "--port", str(replica_port)], direct + "/health"), \
            process([sys.executable, "bench/bare_proxy.py", "--port", str(bare_port), "--replica", direct],
                    bare + "/health"), \
            process([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
                    through + "/ready") as gateway:
        for r in range(args.rounds):
            for name, (body, connections, per_response) in scenarios.items():
                for path, url in paths:
                    cpu0 = cpu_seconds(gateway.pid)
                    # paced responses last 64 x 20 ms: a longer window keeps edge effects small
                    seconds = args.seconds * (3 if "paced " in name else 1)
                    result = wrk(url, body, connections, seconds)
                    if result.errors:
                        raise RuntimeError(f"{name} via {path}: {result.errors} errors")
                    results[name][path].append(result.requests_per_s * per_response)
                    if path == "gateway":
                        results[name]["cpu"].append((cpu_seconds(gateway.pid) - cpu0)
                                                    / (result.requests * per_response))
            for path, url in paths:
                cpu0 = cpu_seconds(gateway.pid)
                lat = asyncio.run(fixed_rate(url, 100, args.seconds * 2))
                latency[path]["p50"].append(pct(lat, 50))
                latency[path]["p99"].append(pct(lat, 99))
                if path == "gateway":
                    cpu_per_request.append((cpu_seconds(gateway.pid) - cpu0) / len(lat))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = statistics.median
    report: dict[str, object] = {}
    print(f"\nGateway overhead, fast fake replica, medians of {args.rounds} rounds of {args.seconds:g} s")
    print(f"{'':34} {'direct':>9} {'bare proxy':>11} {'gateway':>9} {'bare/direct':>12} {'gw/direct':>10}"
          f" {'gw CPU/unit':>13}")
    for name, fig in results.items():
        d, b, g, c = med(fig["direct"]), med(fig["bare"]), med(fig["gateway"]), med(fig["cpu"])
        unit = "chunk" if "chunk" in name else "request"
        print(f"{name:34} {d:9.0f} {b:11.0f} {g:9.0f} {b / d:12.1%} {g / d:10.1%} {c * 1e6:8.0f} us/{unit}")
        report[name] = {"direct": d, "bare_proxy": b, "gateway": g, "bare_ratio": b / d, "ratio": g / d,
                        f"gateway_cpu_us_per_{unit}": c * 1e6}
    for q in ("p50", "p99"):
        d, b, g = (med(latency[path][q]) * 1e3 for path in ("direct", "bare", "gateway"))
        print(f"{'latency ' + q + ' at 100 req/s (ms)':34} {d:9.2f} {b:11.2f} {g:9.2f} {'added ' + format(b - d, '.2f'):>12}"
              f" {'added ' + format(g - d, '.2f'):>10}")
        report[f"latency_{q}_ms"] = {"direct": d, "bare_proxy": b, "gateway": g, "bare_added": b - d,
                                     "added": g - d}
    print(f"{'gateway CPU per request at 100 req/s':38} {med(cpu_per_request) * 1e6:10.0f} us")
    report["gateway_cpu_us_per_request_at_100rps"] = med(cpu_per_request) * 1e6
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
