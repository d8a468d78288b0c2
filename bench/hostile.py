"""Ordinary clients through the gateway, with and without an attack beside them, side by side in one run.

The attack, from a process of its own: a few hundred slow-loris connections (half trickle a request head, half a
request body, one byte a second each, reconnecting whenever the gateway cuts them off) and an open-loop flood of
requests naming models that do not exist, many of them file paths ("/etc/passwd", "/proc/self/environ", ...).
The ordinary clients are the ones bench/gateway_overhead.py uses against a FAST fake replica (bench/fast_replica.py):
wrk at saturation (non-streaming requests/s) and an open-loop Python client at 100 requests/s (p50/p99 latency).
Rounds alternate quiet and attacked; medians are reported, with the attack's own outcome (how many slow
connections the gateway cut off with 408, the flood's statuses) and the gateway's file descriptors and memory.

    python -m bench.hostile [--rounds 3] [--seconds 10] [--loris 300] [--flood-rate 500] [--header-timeout S]
                            [--json FILE]

Needs wrk (Debian/Ubuntu: apt-get install wrk). Wall-clock figures: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway_overhead import ROOT, cpu_seconds, fixed_rate, pct, process, wrk
from deploy.ports import free_ports

PROBES = ("/etc/passwd", "/proc/self/environ", "/root/.ssh/id_rsa", "../../etc/shadow", "/dev/zero", "/tmp")


# -- the attacker (runs in its own process: `python -m bench.hostile --attack URL ...`) --------------------------
class Attack:
    """Slow-loris connections and an unknown-model flood against one gateway; counts what came back."""

    def __init__(self, host: str, port: int, loris: int, flood_rate: float) -> None:
        self.host, self.port = host, port
        self.loris, self.flood_rate = loris, flood_rate
        self.stats: Counter[str] = Counter()
        self.open = 0

    async def slow(self, body: bool) -> None:
        """One slow client, forever: reconnect whenever the gateway closes the connection."""
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        trickle = b"Content-Length: 100000\r\n\r\n" + b"x" * 100000 if body else b"X-Slow: " + b"s" * 100000
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.stats["loris connect failed"] += 1
                await asyncio.sleep(1)
                continue
            self.open += 1
            self.stats["loris connections"] += 1
            reading = asyncio.ensure_future(reader.read(65536))
            try:
                writer.write(head + (trickle[:26] if body else b""))  # a body: the head at once, then the body
                for i in range(26 if body else 0, len(trickle)):
                    writer.write(trickle[i:i + 1])
                    await writer.drain()
                    done, _ = await asyncio.wait((reading,), timeout=1.0)
                    if done:
                        break
                answer = await reading
                status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
                self.stats[f"loris cut off ({status})"] += 1
            except OSError:
                self.stats["loris cut off (reset)"] += 1
            finally:
                self.open -= 1
                reading.cancel()
                writer.close()

    async def flood(self) -> None:
        """Requests for models that do not exist, open-loop at `flood_rate` per second."""
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=64)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
            async def one(model: str) -> None:
                try:
                    async with session.post(f"http://{self.host}:{self.port}/v1/completions",
                                            json={"model": model, "prompt": "x"}) as resp:
                        await resp.read()
                        self.stats[f"flood {resp.status}"] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.stats[f"flood {type(exc).__name__}"] += 1

            tasks: set[asyncio.Task[None]] = set()
            start, i = loop.time(), 0
            while True:
                delay = start + i / self.flood_rate - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                model = random.choice(PROBES) if i % 2 else f"no-such-model-{random.getrandbits(64):x}"
                task = asyncio.create_task(one(model))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1

    async def run(self) -> None:
        workers = [asyncio.create_task(self.slow(body=i % 2 == 1)) for i in range(self.loris)]
        if self.flood_rate:
            workers.append(asyncio.create_task(self.flood()))
        while self.open < self.loris:
            await asyncio.sleep(0.05)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until told to stop
        print(json.dumps({**self.stats, "loris open at the end": self.open}), flush=True)
        for worker in workers:
            worker.cancel()


@contextlib.contextmanager
def attacking(url: str, loris: int, flood_rate: float) -> Iterator[dict[str, float]]:
    """The attacker process, started and ready; yields a dict filled with its counts when it stops."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.hostile", "--attack", url, "--loris", str(loris),
                             "--flood-rate", str(flood_rate)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    outcome: dict[str, float] = {}
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the attacker did not start")
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        yield outcome
        outcome["attacker cores"] = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
        proc.stdin.write("\n")
        proc.stdin.flush()
        outcome.update(json.loads(proc.stdout.readline()))
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the measurement ----------------------------------------------------------------------------------------------
def footprint(pid: int) -> tuple[int, float]:
    """The process's open file descriptors and resident memory (MiB)."""
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return fds, rss / 1024


def measure(url: str, seconds: float) -> dict[str, float]:
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 16}
    result = wrk(url, body, 32, seconds)
    if result.errors:
        raise RuntimeError(f"the ordinary clients saw {result.errors} errors")
    latencies = asyncio.run(fixed_rate(url, 100, seconds))
    return {"requests_per_s": result.requests_per_s, "p50_ms": pct(latencies, 50) * 1e3,
            "p99_ms": pct(latencies, 99) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10, help="per measurement (wrk, then 100 req/s)")
    parser.add_argument("--loris", type=int, default=300, help="slow-loris connections")
    parser.add_argument("--flood-rate", type=float, default=500, help="unknown-model requests per second")
    parser.add_argument("--header-timeout", type=float, help="the gateway's clients.header_timeout_s and "
                        "body_timeout_s (default: the gateway's own defaults, 20 s)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    parser.add_argument("--attack", metavar="URL", help=argparse.SUPPRESS)  # the attacker process
    args = parser.parse_args()
    if args.attack:
        import uvloop

        host, port = args.attack.removeprefix("http://").rsplit(":", 1)
        uvloop.run(Attack(host, int(port), args.loris, args.flood_rate).run())
        return
    if not shutil.which("wrk"):
        sys.exit("bench: wrk is needed (Debian/Ubuntu: apt-get install wrk)")

    replica_port, gateway_port = free_ports(), free_ports()
    direct, url = f"http://127.0.0.1:{replica_port}", f"http://127.0.0.1:{gateway_port}"
    config = Path(tempfile.mkdtemp()) / "gateway.yaml"
    settings: dict[str, Any] = {"replicas": [direct], "port": gateway_port, "host": "127.0.0.1", "log_level": "warning"}
    if args.header_timeout:  # otherwise every client deadline and the connection cap at their defaults
        settings["clients"] = {"header_timeout_s": args.header_timeout, "body_timeout_s": args.header_timeout}
    config.write_text(json.dumps(settings))
    phases: dict[str, list[dict[str, float]]] = {"quiet": [], "attacked": []}
    attacks: list[dict[str, float]] = []
    cores: dict[str, list[float]] = {"quiet": [], "attacked": []}
    fds: dict[str, list[int]] = {"quiet": [], "attacked": []}
    rss: dict[str, list[float]] = {"quiet": [], "attacked": []}
    with process([sys.executable, "bench/fast_replica.py", "--port", str(replica_port)], direct + "/health"), \
            process([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
                    url + "/ready") as gateway:
        for r in range(args.rounds):
            for phase in ("quiet", "attacked"):
                calm: contextlib.AbstractContextManager[dict[str, float]] = contextlib.nullcontext({})
                with attacking(url, args.loris, args.flood_rate) if phase == "attacked" else calm as outcome:
                    cpu0, t0 = cpu_seconds(gateway.pid), time.monotonic()
                    phases[phase].append(measure(url, args.seconds))
                    cores[phase].append((cpu_seconds(gateway.pid) - cpu0) / (time.monotonic() - t0))
                    held, memory = footprint(gateway.pid)
                    fds[phase].append(held)
                    rss[phase].append(memory)
                if phase == "attacked":
                    attacks.append(outcome)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        after = footprint(gateway.pid)

    med = statistics.median
    report: dict[str, Any] = {}
    print(f"\nOrdinary clients with and without {args.loris} slow-loris connections and {args.flood_rate:g} "
          f"unknown-model requests/s, medians of {args.rounds} rounds of {args.seconds:g} s")
    print(f"{'':36} {'quiet':>9} {'attacked':>9} {'attacked/quiet':>15}")
    for key, label in (("requests_per_s", "non-streaming requests/s (wrk)"), ("p50_ms", "p50 latency at 100 req/s (ms)"),
                       ("p99_ms", "p99 latency at 100 req/s (ms)")):
        quiet, attacked = med(p[key] for p in phases["quiet"]), med(p[key] for p in phases["attacked"])
        print(f"{label:36} {quiet:9.2f} {attacked:9.2f} {attacked / quiet:15.1%}")
        report[key] = {"quiet": quiet, "attacked": attacked, "ratio": attacked / quiet}
    print(f"{'gateway CPU (cores busy)':36} {med(cores['quiet']):9.2f} {med(cores['attacked']):9.2f}"
          f"   attacker: {med(a['attacker cores'] for a in attacks):.2f}")
    print(f"{'gateway file descriptors':36} {med(fds['quiet']):9.0f} {med(fds['attacked']):9.0f}"
          f"   after: {after[0]}")
    print(f"{'gateway resident memory (MiB)':36} {med(rss['quiet']):9.1f} {med(rss['attacked']):9.1f}"
          f"   after: {after[1]:.1f}")
    totals: Counter[str] = Counter()
    for outcome in attacks:
        totals.update({k: int(v) for k, v in outcome.items() if k not in ("loris open at the end", "attacker cores")})
    print("the attack, all rounds: " + ", ".join(f"{k}: {v}" for k, v in sorted(totals.items())))
    report.update(fds={**fds, "after": after[0]}, rss_mib={**rss, "after": after[1]}, attack=dict(totals),
                  gateway_cores=cores, attacker_cores=[a["attacker cores"] for a in attacks],
                  rounds=args.rounds, seconds=args.seconds, loris=args.loris, flood_rate=args.flood_rate)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
