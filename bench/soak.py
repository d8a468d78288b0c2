"""`python -m bench.soak`: the real gateway over simulated replicas and a fault injector, for a set time.

    python -m bench.soak [--duration 600] [--replicas 4] [--workers N] [--seed 0] [--out report.json]

The gateway runs as it does in production (`gateway serve`, a subprocess; `--workers N` passed on when given) in
front of `sim serve` replicas (one process each, so each can be killed or frozen alone), each behind an injector
(bench/chaos.py) that logs every request it receives by `x-request-id`. Clients (bench/soak_clients.py) send
Poisson and bursty load, streaming and not, at 70-110% of the replicas' capacity (computed by the simulator for
the request mix), with clients that hang up mid-stream, clients that read slowly and malformed requests mixed in.
Meanwhile, at random times, one replica is killed with SIGKILL and restarted, one frozen with SIGSTOP and resumed,
one answers 500s, one resets connections, one is slowed ten times.

It checks, and reports as a table (exit status 1 if any check fails):
- every request sent got exactly one outcome (complete, or a clean OpenAI error or SSE error event): none hung,
  none lost, none broken; malformed requests never reached a replica;
- no request reached a replica after bytes of its answer had reached its client (the injectors' logs against the
  clients' clocks: both `time.monotonic()`, one clock per machine);
- outstanding tokens, requests in flight and the admission queue back to 0 once idle (from /metrics);
- open file descriptors and asyncio tasks back to their idle level, and memory flat (slope per hour);
- the gateway (and each worker) never restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.chaos import Fault, Injector, Receipt, ReplicaProcess, fault_plan, spawn
from bench.common import markdown_table
from bench.soak_clients import MALFORMED, SLOW_TOKENS, Clients, Outcome, RequestShape
from deploy.ports import free_ports
from sim.fleet import capacity
from sim.gpus import parse_gpu_spec
from sim.model import load_model
from sim.node import NodeSpec
from sim.workload import RequestSpec

MODEL = "opt-125m"  # the simulated model's shape
SERVED = "soak-model"  # the name the replicas serve it as
# A slow simulated GPU, so that a few replicas' capacity is a load this 2-core machine can generate and relay:
# about 1.7 requests/s per replica with 8 sequences in a batch, 100 ms steps.
GPU_SPEC = "memory_gib=4,bandwidth_gbps=4.4,tflops=10,name=soak-gpu"
MAX_NUM_SEQS = 8
MIX = {"json": 0.42, "stream": 0.42, "abort": 0.04, "slow": 0.04, "malformed": 0.08}
SEGMENT_S = 15.0
IDLE_CLOSE_S = 5.0  # the injectors close idle keep-alive connections after this, as vLLM's server does


@dataclass(frozen=True)
class SoakConfig:
    """One soak run's settings."""

    duration_s: float = 600.0
    replicas: int = 4
    workers: int | None = None
    seed: int = 0
    low: float = 0.7
    high: float = 1.1
    stall_s: float = 60.0  # a request that gets no byte for this long is hung (the gateway's timeouts are shorter)
    cap_s: float = 600.0  # ... and one without an outcome by then
    sample_s: float = 2.0
    logs: Path | None = None

    def __post_init__(self) -> None:
        if self.duration_s < 60:
            raise ValueError(f"--duration must be at least 60 s, got {self.duration_s:g}")
        if self.replicas < 3:
            raise ValueError(f"--replicas must be at least 3 (one harmed, two serving), got {self.replicas}")
        if not 0 < self.low <= self.high:
            raise ValueError(f"load levels must satisfy 0 < low <= high, got {self.low:g}, {self.high:g}")

    @property
    def quiet_tail_s(self) -> float:
        return min(30.0, 0.15 * self.duration_s)


@dataclass(frozen=True)
class Sample:
    """The gateway's processes and metrics at one moment."""

    at: float  # seconds since the load started
    fds: int
    rss: int
    tasks: int
    outstanding: float
    inflight: float
    queue: float
    processes: tuple[tuple[int, float], ...]  # (pid, start time) of the gateway and its workers


@dataclass
class Check:
    name: str
    value: str
    bound: str
    ok: bool


@dataclass
class Report:
    config: dict[str, Any]
    capacity_rps: float
    checks: list[Check] = field(default_factory=list)
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    wall_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def table(self) -> str:
        checks = markdown_table(("check", "measured", "bound", "ok"),
                                [(c.name, c.value, c.bound, "yes" if c.ok else "**NO**") for c in self.checks])
        results = sorted({r for counts in self.outcomes.values() for r in counts})
        outcomes = markdown_table(("kind", *results, "total"),
                                  [(kind, *(counts.get(r, 0) for r in results), sum(counts.values()))
                                   for kind, counts in sorted(self.outcomes.items())])
        faults = markdown_table(("at (s)", "fault", "replica", "for (s)"),
                                [(f"{f['start_s']:.1f}", f["kind"], f["replica"], f"{f['duration_s']:.1f}")
                                 for f in self.faults])
        return f"{checks}\n\nOutcomes by client kind:\n\n{outcomes}\n\nFaults:\n\n{faults}\n"


# -- the processes -------------------------------------------------------------------------------------------------
def replica_argv(port: int, seed: int) -> list[str]:
    return [sys.executable, "-m", "sim.cli", "serve", "--model", MODEL, "--gpu-spec", GPU_SPEC, "--replicas", "1",
            "--port", str(port), "--max-num-seqs", str(MAX_NUM_SEQS), "--seed", str(seed), "--log-level", "warning",
            "--served-model-name", SERVED]


def gateway_config(port: int, injectors: Sequence[Injector]) -> dict[str, Any]:
    """Short timeouts (a frozen replica is noticed in seconds); a replica's batch cap as its admission cap (as
    `deploy up` does: requests wait in the gateway's queue, 429s past it, rather than silently in a replica's)."""
    return {
        "host": "127.0.0.1", "port": port, "policy": "least_outstanding_tokens",
        "replicas": [{"url": f"http://127.0.0.1:{i.port}", "max_requests": MAX_NUM_SEQS} for i in injectors],
        "timeouts": {"connect_s": 2, "first_byte_s": 20, "idle_s": 8},
        "health": {"interval_s": 1, "timeout_s": 1}, "retry": {"max_attempts": 3, "max_time_s": 10},
        "queue": {"max_size": 64, "max_wait_s": 10}, "max_body_bytes": 65536, "log_level": "warning",
    }


class GatewayProcess:
    """`gateway serve` in its own process group."""

    def __init__(self, config_path: Path, port: int, workers: int | None, log_path: Path) -> None:
        self.port = port
        self.argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)]
        if workers is not None:
            self.argv += ["--workers", str(workers)]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = spawn(self.argv, self.log_path)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5.0) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()

    async def wait_ready(self, replicas: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited while starting; log {self.log_path}:\n{tail(self.log_path)}")
            try:
                status, body = await asyncio.to_thread(self.get, "/ready")
                if status == 200 and len(json.loads(body)["healthy_replicas"]) == replicas:
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway was not ready within {timeout_s:g} s; log {self.log_path}")
            await asyncio.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- measuring -----------------------------------------------------------------------------------------------------
def scrape(gateway: GatewayProcess) -> dict[str, float]:
    """The gateway's live gauges from /metrics, summed over labels."""
    _, body = gateway.get("/metrics")
    wanted = {"gateway_replica_outstanding_tokens", "gateway_replica_inflight_requests", "gateway_queue_depth",
              "gateway_asyncio_tasks"}
    values = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(body.decode()):
        if family.name in wanted:
            values[family.name] = sum(s.value for s in family.samples)
    return values


def sample(gateway: GatewayProcess, started: float) -> Sample:
    procs = gateway.processes()
    fds = rss = 0
    for proc in procs:
        with proc.oneshot():
            fds += proc.num_fds()
            rss += proc.memory_info().rss
    gauges = scrape(gateway)
    return Sample(time.monotonic() - started, fds, rss, int(gauges["gateway_asyncio_tasks"]),
                  gauges["gateway_replica_outstanding_tokens"], gauges["gateway_replica_inflight_requests"],
                  gauges["gateway_queue_depth"], tuple(sorted((p.pid, p.create_time()) for p in procs)))


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """Theil-Sen slope (the median of the pairwise slopes: robust to a few outliers), per hour."""
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points) for b in points[i + 1:] if b[0] > a[0]]
    if not slopes:
        return 0.0
    slopes.sort()
    return slopes[len(slopes) // 2] * 3600.0


def mix_capacity(config: SoakConfig, rng: random.Random) -> float:
    """Generation requests/s the replicas sustain with the soak's mix (the simulator's own measure)."""
    specs = []
    for _ in range(400):
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        if kind == "malformed":
            continue
        shape = RequestShape.draw(rng)
        output = SLOW_TOKENS if kind == "slow" else shape.max_tokens
        specs.append(RequestSpec(max(1, len(shape.prompt) // 4), output))
    node = NodeSpec(load_model(MODEL), parse_gpu_spec(GPU_SPEC), 1, MAX_NUM_SEQS)
    many = [specs[i % len(specs)] for i in range(max(2000, 8 * MAX_NUM_SEQS))]
    return config.replicas * capacity(node, many)


# -- the run -------------------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.logs = config.logs or Path(tempfile.mkdtemp(prefix="soak-"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self.receipts: list[Receipt] = []
        self.replicas: list[ReplicaProcess] = []
        self.injectors: list[Injector] = []
        self.gateway: GatewayProcess | None = None
        self.samples: list[Sample] = []
        self.fault_log: list[dict[str, Any]] = []
        self.started = 0.0

    async def start(self) -> None:
        for i in range(self.config.replicas):
            port = free_ports()
            replica = ReplicaProcess(i, port, replica_argv(port, self.config.seed + i), self.logs / f"replica-{i}.log")
            replica.start()
            self.replicas.append(replica)
        await asyncio.gather(*(r.wait_ready() for r in self.replicas))
        for replica in self.replicas:
            injector = Injector(replica.index, replica.port, self.receipts, idle_close_s=IDLE_CLOSE_S,
                                rng=random.Random(self.config.seed * 1000 + replica.index))
            await injector.start()
            self.injectors.append(injector)
        port = free_ports()
        config_path = self.logs / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(gateway_config(port, self.injectors)))
        self.gateway = GatewayProcess(config_path, port, self.config.workers, self.logs / "gateway.log")
        self.gateway.start()
        await self.gateway.wait_ready(self.config.replicas)

    async def stop(self) -> None:
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)
        for injector in self.injectors:
            await injector.close()
        for replica in self.replicas:
            await asyncio.to_thread(replica.stop)

    async def sampler(self) -> None:
        assert self.gateway is not None
        while True:
            try:
                self.samples.append(await asyncio.to_thread(sample, self.gateway, self.started))
            except (urllib.error.URLError, OSError, psutil.Error) as exc:
                print(f"soak: sample failed: {exc!r}", file=sys.stderr)
            await asyncio.sleep(self.config.sample_s)

    async def fault(self, fault: Fault) -> None:
        await asyncio.sleep(max(0.0, self.started + fault.start_s - time.monotonic()))
        replica, injector = self.replicas[fault.replica], self.injectors[fault.replica]
        began = time.monotonic() - self.started
        if fault.kind == "kill":
            await asyncio.to_thread(replica.kill)
        elif fault.kind == "freeze":
            replica.freeze()
        else:
            injector.mode = fault.kind
        await asyncio.sleep(fault.duration_s)
        if fault.kind == "kill":
            replica.start()
            await replica.wait_ready()
        elif fault.kind == "freeze":
            replica.thaw()
        else:
            injector.mode = "pass"
        self.fault_log.append({**asdict(fault), "start_s": began, "duration_s": time.monotonic() - self.started
                               - began})

    async def load(self, clients: Clients, rate_per_level: float) -> list[asyncio.Task[None]]:
        """Arrivals until the duration is up: 15 s segments, Poisson or bursty, each at a level in [low, high]."""
        config, rng, loop = self.config, self.rng, asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        segments = math.ceil(config.duration_s / SEGMENT_S)
        levels = [config.low] + [rng.uniform(config.low, config.high) for _ in range(segments - 1)]
        levels[min(2, segments - 1)] = config.high  # the top of the range at least once
        burst_until = calm_until = 0.0
        end = self.started + config.duration_s
        while (now := time.monotonic()) < end:
            segment = int((now - self.started) // SEGMENT_S)
            rate = levels[segment] * rate_per_level
            if segment % 2:  # bursty: bursts (mean 1 s) at 3x the rate, calm (mean 3 s) at a third: the same mean
                if now >= burst_until and now >= calm_until:
                    burst_until = now + rng.expovariate(1.0)
                    calm_until = burst_until + rng.expovariate(1 / 3)
                rate *= 3.0 if now < burst_until else 1 / 3
            await asyncio.sleep(rng.expovariate(rate))
            kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
            if kind == "malformed":
                kind = f"malformed:{rng.choice(MALFORMED)}"
            tasks.append(loop.create_task(clients.send(kind)))
        return tasks

    async def wait_idle(self, timeout_s: float = 30.0) -> tuple[float, Sample | None]:
        """Seconds until outstanding tokens, requests in flight and the queue are all 0 (and that sample)."""
        assert self.gateway is not None
        began = time.monotonic()
        last: Sample | None = None
        while time.monotonic() - began < timeout_s:
            last = await asyncio.to_thread(sample, self.gateway, self.started)
            if last.outstanding == 0 and last.inflight == 0 and last.queue == 0:
                return time.monotonic() - began, last
            await asyncio.sleep(0.25)
        return math.inf, last

    async def run(self) -> Report:
        config = self.config
        capacity_rps = mix_capacity(config, random.Random(config.seed))
        await self.start()
        assert self.gateway is not None
        clients = Clients("127.0.0.1", self.gateway.port, SERVED, config.stall_s, config.cap_s,
                          random.Random(config.seed + 1))
        await clients.open()
        sampler: asyncio.Task[None] | None = None
        try:
            await asyncio.sleep(1.0)  # the health probes' connections are open: the idle baseline
            self.started = time.monotonic()
            idle_before = await asyncio.to_thread(sample, self.gateway, self.started)
            sampler = asyncio.create_task(self.sampler())
            faults = fault_plan(config.duration_s, config.replicas, self.rng, config.quiet_tail_s)
            fault_tasks = [asyncio.create_task(self.fault(f)) for f in faults]
            rate = capacity_rps / (1.0 - MIX["malformed"])  # the generation requests' rate is the level x capacity
            tasks = await self.load(clients, rate)
            load_end = time.monotonic() - self.started
            await asyncio.gather(*tasks)
            await asyncio.gather(*fault_tasks)
            drained = time.monotonic() - self.started
            idle_s, idle_sample = await self.wait_idle()
            await clients.close()  # its keep-alive connections are not the gateway's to account for
            await asyncio.sleep(IDLE_CLOSE_S + 2.0)  # pooled connections to the replicas closed by now
            idle_after = await asyncio.to_thread(sample, self.gateway, self.started)
            alive = self.gateway.proc is not None and self.gateway.proc.poll() is None
        finally:
            if sampler is not None:
                sampler.cancel()
            await clients.close()
            await self.stop()
        report = Report({k: str(v) for k, v in asdict(config).items()}, capacity_rps)
        report.faults = self.fault_log
        report.samples = [asdict(s) for s in self.samples]
        report.requests = len(clients.outcomes)
        report.wall_s = time.monotonic() - self.started
        report.phases = {"load_s": round(load_end, 1), "last_answer_s": round(drained, 1)}
        report.checks = self.checks(clients.outcomes, idle_before, idle_after, idle_s, idle_sample, load_end, alive)
        kinds: dict[str, Counter[str]] = {}
        for outcome in clients.outcomes.values():
            kinds.setdefault(outcome.kind, Counter())[outcome.result] += 1
        report.outcomes = {k: dict(v) for k, v in kinds.items()}
        (self.logs / "outcomes.jsonl").write_text("".join(json.dumps(asdict(o)) + "\n"
                                                          for o in clients.outcomes.values()))
        (self.logs / "receipts.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in self.receipts))
        return report

    def checks(self, outcomes: dict[str, Outcome], idle_before: Sample, idle_after: Sample, idle_s: float,
               idle_sample: Sample | None, load_end: float, alive: bool) -> list[Check]:
        results = Counter(o.result for o in outcomes.values())
        bad = [o for o in outcomes.values() if o.result in ("lost", "hung", "broken")]
        by_id: dict[str, list[Receipt]] = {}
        for receipt in self.receipts:
            by_id.setdefault(receipt.request_id, []).append(receipt)
        late = [(o.request_id, r.replica) for o in outcomes.values() if o.first_byte_at is not None
                for r in by_id.get(o.request_id, []) if r.at > o.first_byte_at]
        leaked = [o.request_id for o in outcomes.values() if o.kind.startswith("malformed") and o.request_id in by_id]
        generation = [o for o in outcomes.values() if not o.kind.startswith("malformed")]
        complete = sum(o.result == "complete" for o in generation)
        slack = self.config.replicas + 2  # probe connections to each replica, and a scrape in progress
        load = [s for s in self.samples if 0.25 * load_end <= s.at <= load_end]
        rss_slope = slope_per_hour([(s.at, s.rss / 2**20) for s in load])
        fds_slope = slope_per_hour([(s.at, s.fds) for s in load])
        tasks_slope = slope_per_hour([(s.at, s.tasks) for s in load])
        processes = {s.processes for s in [idle_before, *self.samples, idle_after]}
        faults = Counter(f["kind"] for f in self.fault_log)
        examples = "; ".join(f"{o.request_id} {o.kind} {o.result}: {o.detail}" for o in bad[:3])
        return [
            Check("requests sent", str(len(outcomes)), "> 0", len(outcomes) > 0),
            Check("exactly one outcome each (lost, hung, broken)",
                  f"{results['lost']}, {results['hung']}, {results['broken']}" + (f" ({examples})" if bad else ""),
                  "0, 0, 0", not bad),
            Check("generation requests complete", f"{complete} of {len(generation)}", ">= 50%",
                  complete >= 0.5 * len(generation)),
            Check("reached a replica after bytes reached the client", str(len(late)), "0", not late),
            Check("malformed requests that reached a replica", str(len(leaked)), "0", not leaked),
            Check("idle: outstanding tokens, in flight, queue",
                  "n/a" if idle_sample is None else
                  f"{idle_sample.outstanding:g}, {idle_sample.inflight:g}, {idle_sample.queue:g} "
                  f"({idle_s:.1f} s after the last answer)", "0, 0, 0 within 30 s", math.isfinite(idle_s)),
            Check("open fds at idle, before -> after", f"{idle_before.fds} -> {idle_after.fds}", f"+{slack} at most",
                  idle_after.fds <= idle_before.fds + slack),
            Check("asyncio tasks at idle, before -> after", f"{idle_before.tasks} -> {idle_after.tasks}",
                  f"+{slack} at most", idle_after.tasks <= idle_before.tasks + slack),
            Check("RSS at idle, before -> after (MiB)",
                  f"{idle_before.rss / 2**20:.1f} -> {idle_after.rss / 2**20:.1f}", "report", True),
            Check("RSS slope under load (MiB/h)", f"{rss_slope:+.1f}", "< 200", rss_slope < 200),
            Check("open fds slope under load (/h)", f"{fds_slope:+.1f}", "report", True),
            Check("asyncio tasks slope under load (/h)", f"{tasks_slope:+.1f}", "report", True),
            Check("gateway processes restarted", str(len(processes) - 1), "0", len(processes) == 1 and alive),
            Check("faults injected (kill, freeze, error, reset, slow)",
                  ", ".join(str(faults[k]) for k in ("kill", "freeze", "error", "reset", "slow")), ">= 1 each",
                  all(faults[k] for k in ("kill", "freeze", "error", "reset", "slow"))),
        ]


def parse_args(argv: Sequence[str] | None) -> tuple[SoakConfig, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default 4)")
    parser.add_argument("--workers", type=int, help="`gateway serve --workers N` (default: the gateway's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--low", type=float, default=0.7, help="lowest load level, x capacity (0.7)")
    parser.add_argument("--high", type=float, default=1.1, help="highest load level, x capacity (1.1)")
    parser.add_argument("--logs", type=Path, help="directory for the processes' logs and the per-request records")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)
    config = SoakConfig(duration_s=args.duration, replicas=args.replicas, workers=args.workers, seed=args.seed,
                        low=args.low, high=args.high, logs=args.logs)
    return config, args.out


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config, out = parse_args(argv)
    except ValueError as exc:
        sys.exit(f"soak: {exc}")
    import uvloop

    soak = Soak(config)
    print(f"soak: {config.duration_s:g} s, {config.replicas} replicas, logs in {soak.logs}", file=sys.stderr, flush=True)
    report = uvloop.run(soak.run())
    if out is not None:
        out.write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(f"capacity {report.capacity_rps:.2f} generation requests/s; {report.requests} requests in "
          f"{report.phases['load_s']:.0f} s, the last answered at {report.phases['last_answer_s']:.0f} s\n")
    print(report.table())
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
