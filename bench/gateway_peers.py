"""This gateway against the proxies a user would pick instead, on one rig, in interleaved rounds.

Peers: vLLM's Rust router (PyPI `vllm-router`), SGLang's Rust router (PyPI `sglang-router`), each in its own
virtual environment under runs/peers/, and nginx (`least_conn`, the system's package). `--install` installs what is
missing (pip from PyPI; apt-get for nginx and wrk). Every peer runs with its default policy; this gateway with its
default policy, API keys on and its client deadlines on (the protections stay on).

The rig: two FAST fake replicas (bench/fast_replica.py) and the load generators on the first cores, each gateway
pinned alone to the last core (`taskset`). For each gateway, in rounds that go through the gateways in turn:
  - CPU per non-streaming request: wrk, 32 connections, the gateway's CPU time (its whole process tree, /proc)
    over the requests served;
  - p50 latency at 100 requests/s, open loop (one Python client; "direct" is the same schedule to a replica);
  - CPU per SSE event, back to back: streams of 64 events written at once;
  - CPU per SSE event, 5 ms apart: streams of 64 events paced like tokens, 64 connections.
Medians over rounds; every figure also as a ratio to the vLLM router's in the same run.

--paired loads each gateway at the same time as the vLLM router in the paced column, both pinned to the gateway
core, each with its own wrk: a round's ratio then sees one machine state. Between sequential rounds this VM's CPU
per paced event moved by 10-30%; two copies of this gateway loaded together agreed within about 1% (5 rounds, A/A).
Through this bench, where each gateway is paired with the router in turn, `--baseline HEAD` gave the same code
0.94x and 0.97x (4 rounds): a difference under about 3% is not a finding.
Only the paced load is paired: it leaves the core half idle, where the saturating columns (wrk as fast as it can)
would make the two gateways share one full core and change what each spends per request (measured: this gateway's
ratio per request 0.40x paired against 0.23x alone).

    python -m bench.gateway_peers [--install] [--rounds 3] [--seconds 5] [--baseline REV] [--paired] [--save]

--baseline REV adds this gateway as it was at git revision REV, from a temporary worktree: a change's A/B on the
same rig in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.common import RESULTS, markdown_table, worktree
from bench.gateway_overhead import ROOT, fixed_rate, pct, wrk
from bench.gpu.cpu import tree_cpu_seconds
from deploy.ports import free_ports

PEERS_DIR = ROOT / "runs" / "peers"
KEY = "sk-bench"
EVENTS = 64
PACED_MS = 5
REFERENCE = "vLLM router"


@dataclass(frozen=True)
class Gateway:
    name: str
    argv: Callable[[int, list[str], Path], list[str]]  # (port, replica URLs, work dir) -> command
    installed: Callable[[], bool]


def _router(package: str, module: str) -> Callable[[int, list[str], Path], list[str]]:
    def argv(port: int, replicas: list[str], workdir: Path) -> list[str]:
        return [str(PEERS_DIR / package / "bin" / "python"), "-m", module, "--host", "127.0.0.1", "--port",
                str(port), "--worker-urls", *replicas, "--prometheus-port", str(free_ports())]
    return argv


def _nginx(port: int, replicas: list[str], workdir: Path) -> list[str]:
    servers = "".join(f"server {u.removeprefix('http://')};" for u in replicas)
    conf = workdir / f"nginx-{port}.conf"
    conf.write_text(
        f"worker_processes 1; pid {workdir}/nginx-{port}.pid; error_log {workdir}/nginx-{port}.err warn;"
        "events { worker_connections 4096; }"
        f"http {{ access_log off; client_body_temp_path {workdir}; proxy_temp_path {workdir};"
        f" upstream replicas {{ least_conn; {servers} keepalive 64; }}"
        f" server {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://replicas;"
        " proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off; } } }")
    return ["nginx", "-c", str(conf), "-g", "daemon off;"]


def _ours(port: int, replicas: list[str], workdir: Path) -> list[str]:
    config = workdir / f"gateway-{port}.yaml"
    config.write_text(json.dumps({
        "replicas": [{"url": u, "max_requests": 100000, "max_outstanding_tokens": 10**9} for u in replicas],
        "host": "127.0.0.1", "port": port, "api_keys": [KEY], "log_level": "warning",
        "queue": {"max_size": 10000, "max_wait_s": 30}}))
    return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]


GATEWAYS = (
    Gateway("nginx least_conn", _nginx, lambda: shutil.which("nginx") is not None),
    Gateway(REFERENCE, _router("vllm-router", "vllm_router.launch_router"),
            lambda: (PEERS_DIR / "vllm-router" / "bin" / "vllm-router").exists()),
    Gateway("SGLang router", _router("sglang-router", "sglang_router.launch_router"),
            lambda: (PEERS_DIR / "sglang-router" / "bin" / "python").exists()),
    Gateway("this gateway", _ours, lambda: True),
)


def install() -> None:
    """The peers' virtual environments from PyPI, nginx and wrk from the system's packages."""
    for package in ("vllm-router", "sglang-router"):
        venv = PEERS_DIR / package
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", package],
                       check=True, timeout=900)
    missing = [p for p in ("nginx", "wrk") if shutil.which(p) is None]
    if missing:
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        subprocess.run([*sudo, "apt-get", "install", "-y", "-q", *missing], check=True, timeout=900)


def cpus() -> tuple[list[int], list[int]]:
    """(cores for the replicas and the load, the core for the gateway under test)."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        sys.exit("bench: two cores at least (one for the gateway under test)")
    return available[:-1], available[-1:]


def pinned(argv: list[str], cores: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores)), *argv]


def answer_ok(url: str) -> bool:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def started(argv: list[str], url: str, log: Path, timeout_s: float = 60, cwd: Path = ROOT
            ) -> Iterator[psutil.Process]:
    """The command running in `cwd` (its own process group) and answering completions at `url`."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the tree's own gateway, not the installed one
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not answer_ok(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log.stem} did not answer at {url}: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield psutil.Process(proc.pid)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def cpu_s(process: psutil.Process) -> float:
    """CPU seconds of a process and its children (nginx's worker), every thread (the Rust routers' runtimes)."""
    return tree_cpu_seconds(process.pid, False) + tree_cpu_seconds(process.pid, True)


SCENARIOS: dict[str, tuple[dict[str, Any], int, int, float]] = {  # body, connections, units per answer, x seconds
    "CPU us per request": ({"model": "fake-model", "prompt": "hello", "max_tokens": 16}, 32, 1, 1.0),
    "CPU us per event, back to back": ({"model": "fake-model", "prompt": "hello", "max_tokens": EVENTS,
                                        "stream": True}, 32, EVENTS, 1.0),
    f"CPU us per event, {PACED_MS} ms apart": ({"model": "fake-model", "prompt": "hello", "max_tokens": EVENTS,
                                               "stream": True, "bench_itl_ms": PACED_MS}, 64, EVENTS, 2.0),
}
P50 = "p50 us at 100 req/s"
COLUMNS = dict(zip(("request", "b2b", "paced", "p50"), [*SCENARIOS, P50]))  # --only's short names


def fake_replicas(stack: ExitStack, n: int, cores: list[int], workdir: Path) -> list[str]:
    """`n` fast fake replicas pinned to `cores`, running until `stack` closes: their URLs."""
    urls = []
    for i in range(n):
        port = free_ports()
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(started(pinned([sys.executable, "bench/fast_replica.py", "--port", str(port)], cores),
                                    url, workdir / f"replica-{i}.log"))
        urls.append(url)
    return urls


def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_cores, gateway_core = cpus()
    os.sched_setaffinity(0, load_cores)  # this process is the open-loop client
    workdir = Path(tempfile.mkdtemp(prefix="peers-"))
    columns = [COLUMNS[c] for c in args.only or COLUMNS]
    figures: dict[str, dict[str, list[float]]] = {}
    with ExitStack() as stack:
        replicas = fake_replicas(stack, 2, load_cores, workdir)
        running = {}
        if args.baseline:  # this gateway as it was at that revision, on the same rig
            tree = stack.enter_context(worktree(args.baseline))
            port = free_ports()
            url = f"http://127.0.0.1:{port}"
            running[f"this gateway at {args.baseline}"] = (url, stack.enter_context(started(
                pinned(_ours(port, replicas, workdir), gateway_core), url, workdir / "baseline.log", cwd=tree)))
        for gateway in GATEWAYS:
            if gateway.name not in (REFERENCE, "this gateway") and args.peers == "reference":
                continue
            if not gateway.installed():
                print(f"bench: {gateway.name} is not installed (--install): left out", file=sys.stderr)
                continue
            port = free_ports()
            url = f"http://127.0.0.1:{port}"
            process = stack.enter_context(started(pinned(gateway.argv(port, replicas, workdir), gateway_core), url,
                                                  workdir / f"{gateway.name.replace(' ', '-')}.log"))
            running[gateway.name] = (url, process)
        paired: dict[str, dict[str, list[float]]] = {}
        if args.paired and REFERENCE not in running:
            raise RuntimeError(f"--paired needs the {REFERENCE} (--install)")
        for r in range(args.rounds):
            order = list(running.items())[::-1 if r % 2 else 1]
            for scenario, (body, connections, units, stretch) in SCENARIOS.items():
                if scenario not in columns:
                    continue
                if args.paired and "bench_itl_ms" in body:  # each gateway beside the reference: a ratio per round
                    for name, (url, process) in order:
                        if name == REFERENCE:
                            continue
                        mine, theirs = cpu_per_unit_together(
                            [(name, url, process), (REFERENCE, *running[REFERENCE])], scenario, body, connections, units,
                            args.seconds * stretch, load_cores)
                        figures.setdefault(scenario, {}).setdefault(name, []).append(mine)
                        figures[scenario].setdefault(REFERENCE, []).append(theirs)
                        paired.setdefault(scenario, {}).setdefault(name, []).append(mine / theirs)
                    continue
                for name, (url, process) in order:
                    figures.setdefault(scenario, {}).setdefault(name, []).append(cpu_per_unit_together(
                        [(name, url, process)], scenario, body, connections, units, args.seconds * stretch,
                        load_cores)[0])
            for name, url in [("direct", replicas[0]), *((n, u) for n, (u, _) in order)] if P50 in columns else []:
                lat = asyncio.run(fixed_rate(url, 100, args.seconds * 2, headers={"Authorization": f"Bearer {KEY}"}))
                figures.setdefault(P50, {}).setdefault(name, []).append(pct(lat, 50) * 1e6)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    return {"rounds": args.rounds, "seconds": args.seconds, "load_cores": load_cores, "gateway_core": gateway_core,
            "figures": figures, "paired": paired,
            "command": " ".join(["python -m bench.gateway_peers", *sys.argv[1:]])}


def cpu_per_unit_together(gateways: list[tuple[str, str, subprocess.Popen[bytes]]], scenario: str,
                          body: dict[str, Any], connections: int, units: int, seconds: float,
                          load_cores: list[int]) -> list[float]:
    """CPU us per unit of each gateway (name, url, process), all loaded by their own wrk over the same seconds."""
    before = [cpu_s(process) for _, _, process in gateways]
    with ThreadPoolExecutor(len(gateways)) as pool:
        results = list(pool.map(lambda g: wrk(g[1], {**body}, connections, seconds, auth=KEY, cores=load_cores),
                                gateways))
    figures = []
    for (name, _, process), start, result in zip(gateways, before, results):
        if result.errors or not result.requests:
            raise RuntimeError(f"{scenario} via {name}: {result.errors} errors in {result.requests} requests")
        figures.append((cpu_s(process) - start) / (result.requests * units) * 1e6)
    return figures


def report(result: dict[str, Any]) -> str:
    figures = result["figures"]
    columns = [c for c in (*SCENARIOS, P50) if c in figures]
    names = [n for n in figures[columns[0]] if n != "direct"]
    rows = []
    paired = result.get("paired", {})
    for name in names:
        row: list[object] = [name]
        for column in columns:
            value, reference = (statistics.median(figures[column][n]) for n in (name, REFERENCE))
            ratios = paired.get(column, {}).get(name)
            if ratios:  # measured at the same time as the reference: the median of the rounds' own ratios
                row.append(f"{value:.1f} ({statistics.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f})")
            else:
                row.append(f"{value:.1f} ({value / reference:.2f}x)")
        rows.append(row)
    direct = statistics.median(figures[P50]["direct"]) if P50 in figures else float("nan")
    return "\n".join([
        "# This gateway against its peers", "",
        f"`{result['command']}`: two fast fake "
        f"replicas and the load on cores {result['load_cores']}, each gateway alone on core "
        f"{result['gateway_core']}; medians of {result['rounds']} interleaved rounds, ratios to the {REFERENCE}. "
        + (f"Paced column paired: each gateway loaded at the same time as the {REFERENCE}, both on that core, its "
           "ratio the median of the rounds' own ratios (their range after it). " if paired else "")
        + f"Direct to a replica, p50 at 100 req/s: {direct:.0f} us.", "",
        markdown_table(["gateway", *columns], rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install", action="store_true", help="install the peers (PyPI) and nginx, wrk (apt)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--baseline", metavar="REV", help="also this gateway as it was at git revision REV (A/B)")
    parser.add_argument("--only", action="append", choices=list(COLUMNS),
                        help="measure only this column (repeatable): a longer A/B of one figure")
    parser.add_argument("--peers", choices=("all", "reference"), default="all",
                        help="reference: the vLLM router and this gateway only")
    parser.add_argument("--paired", action="store_true",
                        help="paced column: load each gateway at the same time as the vLLM router (both on the "
                        "gateway core), so that a round's ratio sees one machine state; two runs of one gateway agree "
                        "within about 1%% this way, against 10-30%% between sequential rounds (through this bench, "
                        "each gateway paired with the router in turn: within about 3%%)")
    parser.add_argument("--save", action="store_true", help="write docs/bench/gateway_overhead.md and "
                        "docs/bench/gateway_peers.json")
    args = parser.parse_args()
    if args.save and (args.only or args.peers != "all"):
        parser.error("--save keeps the whole table: not with --only or --peers reference")
    if args.install:
        install()
    if shutil.which("wrk") is None:
        sys.exit("bench: wrk is needed (--install, or apt-get install wrk)")
    result = measure(args)
    text = report(result)
    print(text)
    if args.save:
        (RESULTS / "gateway_peers.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / "gateway_overhead.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
