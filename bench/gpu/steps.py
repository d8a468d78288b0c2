"""The benchmark's steps. Each measures only the points not yet on disk, so a rerun (or the next 10-minute
command on the GPU machine) resumes where the last one stopped.

- `frontier`: one instance (the papers' 0.9 of the GPU, max_num_seqs the largest B) driven in closed loop at
  each batch cap B: `planner profile`'s own point files (Fig. 1 of arXiv 2404.03353). Then, the instance idle,
  what its prefill costs by the cached context it attends to (`bench.prefill_cost`: the simulator's calibration
  takes it, see bench/gpu/simfit.py). Then, on the same instance capped at its best B by the gateway, Poisson
  arrivals at each load: the baseline a user would otherwise pick.
- `plan`: `planner plan` on that frontier (B*, the replica count, each replica's memory). When it keeps fewer
  than `min_replicas`, that many are measured anyway, in the papers' layout (0.9 / N of the GPU each), since
  whether replication pays is the question.
- `replicas`: the plan's N replicas started once; `planner validate`'s measurement of 1..N of them through the
  gateway, k x B* requests in flight (Fig. 5 of arXiv 2503.08311, without MPS); then each routing policy at each
  Poisson rate over all N (Figs. 4, 6, 7: TTFT, ITL, tokens/s, GPU).
- `mps`: the same counts with the replicas under NVIDIA MPS.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import prefill_cost as probe
from bench.gpu.cluster import SampledDeployer, cpu_meter, gateway, replicas, resolve_plan
from bench.gpu.settings import Settings
from bench.gpu.store import Store
from deploy.hardware import Hardware
from deploy.models import ResolvedModel
from deploy.plan import Admission, GatewaySpec, Plan, ReplicaSpec, load
from planner import modelinfo
from planner.client import Timeouts
from planner.errors import MemoryPlanError
from planner.gpu import GpuSampler
from planner.planning import PlanConfig, make_plan, split_vllm_args, write_plan
from planner.points import ProfileContext, ProfilePoint
from planner.profiler import ProfileConfig, Profiler
from planner.servers import RunningServer
from planner.sources import load_profile, point_path, read_point
from planner.validate import ValidateConfig, Validator, best_of, explain, sub_plan
from planner.workload import FixedLengths, WorkloadSource, prompt_builder

logger = logging.getLogger(__name__)

SHORT = {"least_outstanding_tokens": "lot", "round_robin": "rr", "random": "random", "least_requests": "lr",
         "power_of_two": "p2c"}


@dataclass
class Context:
    """What every step works with."""

    settings: Settings
    store: Store
    hardware: Hardware
    sampler: GpuSampler | None
    log: Callable[[str], None] = print

    @property
    def out(self) -> Path:
        return self.settings.out

    @property
    def profile_dir(self) -> Path:
        return self.settings.out / "frontier"

    def timeouts(self) -> Timeouts:
        return Timeouts(request_s=self.settings.request_timeout_s)


def routing_name(policy: str, load_: float) -> str:
    return f"{SHORT.get(policy, policy)}-load{load_:g}"


def served_name(model: ResolvedModel) -> str:
    return model.served_name or model.source


def tokenizer_of(model: ResolvedModel) -> str | None:
    return model.source if (Path(model.source) / "tokenizer.json").is_file() else None


def workload_for(settings: Settings, model: ResolvedModel) -> WorkloadSource:
    """The papers' fixed lengths (ignore_eos), prompts cut to exact length with the model's tokenizer."""
    return FixedLengths(settings.input_tokens, settings.output_tokens, prompt_builder(tokenizer_of(model), None))


# --- frontier ---------------------------------------------------------------------------------------------


def single_plan(settings: Settings) -> Plan:
    """One instance as the papers ran it: 0.9 of the GPU (or the CPU KV cache), capped at the largest B."""
    max_model_len, extra = split_vllm_args(settings.vllm_args)
    spec = ReplicaSpec(name="single", model=settings.model, port=settings.single_port,
                       max_num_seqs=max(settings.batch_sizes), max_model_len=max_model_len,
                       gpu_memory_utilization=0.9 if settings.device == "gpu" else None,
                       cpu_kvcache_space_gib=settings.cpu_kvcache_gib if settings.device == "cpu" else None,
                       extra_args=extra, admission=Admission(max_requests=max(settings.batch_sizes)))
    return Plan(model=settings.model, replicas=(spec,), gateway=GatewaySpec(port=settings.port, queue_size=100_000,
                                                                            queue_wait_s=600.0))


def profile_context(ctx: Context, model: ResolvedModel, workload: WorkloadSource) -> ProfileContext:
    s, sampler = ctx.settings, ctx.sampler
    facts = s.model if modelinfo.spec(s.model) is not None else model.source
    return ProfileContext(model=s.model, device=s.device, workload=workload.describe(), vllm_args=s.vllm_args,
                          weights_bytes=modelinfo.weights_bytes(facts),
                          kv_bytes_per_token=modelinfo.kv_bytes_per_token(facts),
                          cpu_kvcache_space_gib=s.cpu_kvcache_gib if s.device == "cpu" else None,
                          gpu_name=sampler.name if sampler else None,
                          gpu_memory_total_bytes=sampler.memory_total_bytes if sampler else None,
                          source=str(ctx.profile_dir))


def best_point(profile_dir: Path) -> ProfilePoint:
    """The single instance's best measured throughput over B (its capacity is that point's request rate)."""
    return max(load_profile(profile_dir).points, key=lambda p: (p.total_tok_s, -p.batch_size))


def frontier(ctx: Context) -> None:
    s = ctx.settings
    todo = [b for b in sorted(s.batch_sizes) if not point_path(ctx.profile_dir, b).exists()]
    baseline = [x for x in s.loads if not ctx.store.has("routing", routing_name("single", x))]
    need_cost = not ctx.store.has("frontier", "prefill_cost")
    if not todo and not baseline and not need_cost:
        ctx.log("frontier: every point is measured already")
        return
    plan, models = resolve_plan(single_plan(s), ctx.hardware)
    model = models[s.model]
    workload = workload_for(s, model)
    context = profile_context(ctx, model, workload)
    if ctx.sampler is not None:
        ctx.sampler.mark_baseline()  # GPU memory before vLLM: the plan measures vLLM's overhead from it
    with replicas(plan, ctx.hardware, ctx.out / "run" / "single", startup_timeout_s=s.startup_timeout_s,
                  log=ctx.log) as running:
        ctx.store.put("frontier", "startup", {"startup_s": running.startup_s})
        url, req_s = running.urls[0], None
        for b in sorted(s.batch_sizes):
            path = point_path(ctx.profile_dir, b)
            if not path.exists():
                config = ProfileConfig(out=ctx.profile_dir, batch_sizes=(b,), num_requests=s.requests_for(b, req_s),
                                       warmup_requests=s.warmup_requests, model_name=served_name(model),
                                       metrics_interval_s=0.5, timeouts=ctx.timeouts(),
                                       client_processes=s.client_processes)
                Profiler(config, RunningServer(url), workload, context, ctx.sampler, out=ctx.log).run()
            req_s = read_point(path)[1].req_s
        if need_cost:
            prefill_cost(ctx, url)
        best = best_point(ctx.profile_dir)
        capacity = best.req_s or 0.0
        for x in baseline:
            with gateway(plan, ctx.hardware, ctx.out / "run" / "gw-single", 1, "least_outstanding_tokens", s.port,
                         batch_cap=best.batch_size, workers=s.gateway_workers) as url:
                routing_point(ctx, url, model, x * capacity, routing_name("single", x),
                              {"policy": "single instance", "replicas": 1, "load": x, "batch_cap": best.batch_size,
                               "capacity_req_s": capacity})


def prefill_cost(ctx: Context, url: str) -> None:
    """`bench.prefill_cost` on the idle instance at `url`: one request at a time, each after a prefix it has just
    cached, vLLM's own prefill time; stored as `python -m bench.prefill_cost --out` writes it, which `sim calibrate
    --prefill-cost` reads."""
    started = time.monotonic()
    try:
        readings, fit = probe.run(url, ctx.settings.prefill_reps, ctx.settings.seed)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:  # kept, said, and the benchmark goes on
        ctx.store.put("frontier", "prefill_cost", {"replica": url, "error": str(exc)})
        ctx.log(f"  prefill cost: not measured: {exc}")
        return
    ctx.store.put("frontier", "prefill_cost", {**probe.record(url, readings, fit),
                                               "elapsed_s": round(time.monotonic() - started, 1)})
    ctx.log(f"  prefill cost: {fit.base_s * 1e3:.2f} ms + {fit.per_token_s * 1e6:.2f} us a token + "
            f"{fit.per_pair_s * 1e9:.3f} ns a (query, key) pair, over {len(readings)} cells")


def routing_point(ctx: Context, url: str, model: ResolvedModel, rate: float, name: str,
                  meta: dict[str, Any]) -> None:
    """Poisson arrivals at `rate` through the gateway at `url` (a real Locust run), GPU sampled meanwhile."""
    from loadtest.cli import report_run
    from loadtest.config import LoadConfig
    from loadtest.runner import run_locust
    from loadtest.schedules import ArrivalSpec
    from loadtest.workloads import WorkloadSpec

    s = ctx.settings
    out = ctx.out / "loadtest" / name
    config = LoadConfig(hosts=(url,), model=served_name(model), mode="open",
                        arrival=ArrivalSpec(kind="poisson", rate=rate, duration=s.rate_duration_s, seed=s.seed),
                        workload=WorkloadSpec(kind="fixed", input_len=s.input_tokens, output_len=s.output_tokens,
                                              tokenizer=tokenizer_of(model), seed=s.seed),
                        out_dir=str(out), drain_timeout=s.drain_s, read_timeout=s.request_timeout_s)
    ctx.log(f"  {name}: Poisson {rate:.2f} req/s for {s.rate_duration_s:g} s through {url}")
    started = time.monotonic()
    if ctx.sampler is not None:
        ctx.sampler.start()
    try:
        result = run_locust(config, out)
    finally:
        gpu = ctx.sampler.stop() if ctx.sampler is not None else None
    summary = report_run(config, result.records, out)
    ctx.store.put("routing", name, {**meta, "rate_req_s": round(rate, 3), "summary": summary,
                                    "gpu": asdict(gpu) if gpu else None,
                                    "elapsed_s": round(time.monotonic() - started, 1)})
    ctx.log(f"  {name}: {summary['total_token_throughput']:.0f} tok/s, TTFT p50 "
            f"{_ms(summary.get('median_ttft_ms'))} p99 {_ms(summary.get('p99_ttft_ms'))}, ITL p50 "
            f"{_ms(summary.get('median_itl_ms'))} ms, {summary['failed']} failed")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


# --- plan -------------------------------------------------------------------------------------------------


def plan(ctx: Context) -> None:
    s = ctx.settings
    measured_path = ctx.out / "plan-measured.yaml"
    if measured_path.exists() and ctx.store.has("plan", "plan"):
        ctx.log(f"plan: done already ({measured_path})")
        return
    profile = load_profile(ctx.profile_dir)
    config = PlanConfig(device=s.device, max_replicas=s.max_replicas, base_port=s.port + 1, gateway_port=s.port,
                        queue_size=100_000, queue_wait_s=600.0)
    planned = make_plan(profile, config)
    write_plan(planned, ctx.out / "plan.yaml")
    measured, why = planned, "the planner's count"
    if len(planned.replicas) < s.min_replicas:
        try:
            measured = make_plan(profile, replace(config, replicas=s.min_replicas))
            why = (f"the planner keeps {len(planned.replicas)}; {s.min_replicas} measured as well (they fit, "
                   "with the planner's margins) to see whether replication pays")
        except MemoryPlanError as exc:
            measured = papers_layout(planned, s.min_replicas, s.device)
            why = (f"the planner keeps {len(planned.replicas)} ({exc}); {s.min_replicas} measured anyway in the "
                   "papers' layout, 0.9 / N of the GPU each (vLLM preempts if their KV caches run short; the "
                   "preemptions are counted)")
    write_plan(measured, measured_path)
    ctx.store.put("plan", "plan", {"b_star": planned.reasoning["batch"]["b_star"],
                                   "planned_replicas": len(planned.replicas),
                                   "measured_replicas": len(measured.replicas), "why": why,
                                   "summary": planned.reasoning["summary"],
                                   "memory": planned.reasoning["memory"], "layout": planned.reasoning["layout"]})
    ctx.log(f"plan: {planned.reasoning['summary']}\nplan: measuring {len(measured.replicas)} replica(s): {why}")


def papers_layout(planned: Plan, count: int, device: str) -> Plan:
    """`count` copies of the planned replica, each with 0.9 / count of the GPU (the papers' layout)."""
    first = planned.replicas[0]
    share = math.floor(0.9 / count * 100) / 100
    specs = tuple(replace(first, name=f"r{i}", port=first.port + i,
                          gpu_memory_utilization=share if device == "gpu" else None, kv_cache_memory_bytes=None)
                  for i in range(count))
    return replace(planned, replicas=specs)


# --- replicas (Fig. 5) and routing (Figs. 4, 6, 7) ---------------------------------------------------------


def b_star_of(plan_: Plan) -> int:
    batch = plan_.reasoning.get("batch") or {}
    cap = batch.get("b_star") or plan_.replicas[0].max_num_seqs
    return int(cap or 1)


def replica_counts(ctx: Context, mps: bool) -> None:
    s = ctx.settings
    step = "mps" if mps else "replicas"
    if mps and s.device != "gpu":
        ctx.store.put("mps", "unavailable", {"reason": "NVIDIA MPS needs an NVIDIA GPU; this run is on the CPU"})
        ctx.log("mps: skipped (no NVIDIA GPU)")
        return
    planned = load(ctx.out / "plan-measured.yaml")
    n, b_star = len(planned.replicas), b_star_of(planned)
    counts = [k for k in range(1, n + 1) if not ctx.store.has(step, f"k{k}")]
    direct = [k for k in range(1, n + 1) if s.direct and not ctx.store.has(step, f"direct-k{k}")]
    through = [k for k in range(1, n + 1) if s.direct and not ctx.store.has(step, f"gateway-k{k}")]
    routes = [] if mps else [(p, x) for p in s.policies for x in s.loads
                             if not ctx.store.has("routing", routing_name(p, x))]
    if not counts and not direct and not through and not routes:
        ctx.log(f"{step}: every point is measured already")
        decide(ctx, step)
        return
    resolved, models = resolve_plan(planned, ctx.hardware)
    model = models[planned.replicas[0].model]
    workload = workload_for(s, model)
    best = best_point(ctx.profile_dir)
    one = load_profile(ctx.profile_dir).point(b_star) if b_star in s.batch_sizes else best
    with replicas(resolved, ctx.hardware, ctx.out / "run" / step, mps=mps, startup_timeout_s=s.startup_timeout_s,
                  log=ctx.log) as running:
        if mps and not running.mps:
            ctx.store.put("mps", "unavailable", {"reason": "the MPS control daemon did not start; see "
                                                           f"{ctx.out / 'run' / step / 'mps'}"})
            ctx.log("mps: the MPS control daemon did not start; skipped")
            return
        deployer = SampledDeployer(resolved, ctx.hardware, ctx.out / "run" / step, s.port, sampler=ctx.sampler,
                                   workers=s.gateway_workers, replica_pids=running.pids)
        for k in counts:
            started = time.monotonic()
            n_requests = s.requests_for(k * b_star, (one.req_s or 0) * k or None)
            validator = Validator(resolved, ValidateConfig(counts=(k,), num_requests=n_requests, min_gain=s.min_gain,
                                                           warmup_requests=s.warmup_requests,
                                                           timeouts=ctx.timeouts(), clients=1),
                                  deployer, workload, out=ctx.log)
            result = validator.measure(k)
            ctx.store.put(step, f"k{k}", {**result.to_dict(), "mps": running.mps, "b_star": b_star,
                                          "gpu": asdict(deployer.last_gpu) if deployer.last_gpu else None,
                                          "cpu_cores": deployer.last_cpu,
                                          "startup_s": running.startup_s,
                                          "elapsed_s": round(time.monotonic() - started, 1)})
        for k in through:
            gateway_clients_count(ctx, step, deployer, resolved, k, model, b_star, one.req_s)
        for k in direct:
            direct_count(ctx, step, running.urls[:k], running.pids[:k], model, b_star, one.req_s)
        capacity = best.req_s or 0.0
        for policy, x in routes:
            with gateway(resolved, ctx.hardware, ctx.out / "run" / f"gw-{SHORT.get(policy, policy)}", n, policy,
                         s.port, workers=s.gateway_workers) as url:
                routing_point(ctx, url, model, x * capacity, routing_name(policy, x),
                              {"policy": policy, "replicas": n, "load": x, "batch_cap": b_star,
                               "capacity_req_s": capacity})
    decide(ctx, step)


def client_argv(settings: Settings, model: ResolvedModel, b_star: int, n_requests: int) -> list[str]:
    """`planner profile --url` at B*: the client process the benchmark drives replicas and gateways with."""
    argv = [sys.executable, "-m", "planner.cli", "profile", "--batch-sizes", str(b_star), "--num-requests",
            str(n_requests), "--input-tokens", str(settings.input_tokens), "--output-tokens",
            str(settings.output_tokens), "--served-model-name", served_name(model), "--warmup",
            str(settings.warmup_requests), "--request-timeout", str(settings.request_timeout_s),
            "--metrics-interval", "0.5", "--client-processes", str(settings.client_processes)]
    tokenizer = tokenizer_of(model)
    return [*argv, "--tokenizer", tokenizer] if tokenizer else argv


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended and been waited for (and of theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def drive(run: Path, urls: Sequence[str], argv: Sequence[str], b_star: int,
          limit_s: float) -> tuple[list[ProfilePoint], float]:
    """One client process per URL (a URL may repeat: several clients of one gateway), all at once; each
    client's point, and the cores the clients used together (their CPU seconds, read when they have been
    waited for, over the wall time)."""
    started, cpu_before = time.monotonic(), children_cpu_s()
    with contextlib.ExitStack() as stack:
        procs = []
        for i, url in enumerate(urls):
            out = run / f"r{i}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            log = stack.enter_context(open(out / "client.log", "w"))
            procs.append(subprocess.Popen([*argv, "--url", url, "--out", str(out)], stdout=log,
                                          stderr=subprocess.STDOUT))
            stack.callback(_end, procs[-1])  # on any way out (a failure, a timeout, Ctrl-C): none left running
        for i, proc in enumerate(procs):
            code = proc.wait(timeout=max(1.0, limit_s - (time.monotonic() - started)))
            if code != 0:
                raise RuntimeError(f"client {i} exited with code {code}; see {run / f'r{i}'}")
    cores = (children_cpu_s() - cpu_before) / max(time.monotonic() - started, 1e-9)
    return [read_point(point_path(run / f"r{i}", b_star))[1] for i in range(len(urls))], round(cores, 2)


def pooled(points: Sequence[ProfilePoint]) -> dict[str, Any]:
    """Clients run side by side as one measurement: every client's tokens over the longest run (a client that
    finishes early counts as idle), and the sum of their steady rates (None if one has none)."""
    longest = max(p.duration_s or 0.0 for p in points)
    total = sum(p.total_tok_s * (p.duration_s or 0.0) for p in points) / longest if longest else 0.0
    steady = [p.steady_tok_s for p in points if p.steady_tok_s is not None]
    return {"total_tok_s": round(total, 1),
            "steady_tok_s": round(sum(steady), 1) if len(steady) == len(points) else None,
            "per_client_tok_s": [p.total_tok_s for p in points], "duration_s": [p.duration_s for p in points],
            "steady_s": [p.steady_s for p in points], "preemptions": [p.preemptions for p in points],
            "failed": [p.failed_requests for p in points]}


def direct_count(ctx: Context, step: str, urls: Sequence[str], pids: list[int], model: ResolvedModel,
                 b_star: int, req_s: float | None) -> None:
    """`len(urls)` replicas driven straight, each by its own `planner profile --url` process at B* (no gateway,
    no shared client): what the GPU gives apart from the gateway's cost, as the papers measured it."""
    s, k = ctx.settings, len(urls)
    n_requests = s.requests_for(b_star, req_s)
    ctx.log(f"{k} replica(s) straight: {n_requests} requests each, {b_star} at a time, one client per replica")
    started = time.monotonic()
    meter = cpu_meter(pids)
    meter.start()
    if ctx.sampler is not None:
        ctx.sampler.start()
    try:
        points, client = drive(ctx.out / "run" / step / f"direct-k{k}", urls,
                               client_argv(s, model, b_star, n_requests), b_star, s.request_timeout_s + 60.0)
    finally:
        gpu = ctx.sampler.stop() if ctx.sampler is not None else None
        cpu = meter.stop()
    result = pooled(points)
    ctx.store.put(step, f"direct-k{k}", {
        "replicas": k, "batch_size": b_star, "requests_each": n_requests, **result,
        "per_replica_tok_s": result["per_client_tok_s"], "gpu": asdict(gpu) if gpu else None,
        "cpu_cores": {**cpu, "clients": client}, "elapsed_s": round(time.monotonic() - started, 1)})
    ctx.log(f"{k} replica(s) straight: {_tok(result)} together "
            f"({', '.join(f'{p.total_tok_s:,.0f}' for p in points)} each); clients {client:.2f} cores")


def gateway_clients_count(ctx: Context, step: str, deployer: SampledDeployer, plan_: Plan, k: int,
                          model: ResolvedModel, b_star: int, req_s: float | None) -> None:
    """The first k replicas through the gateway, driven by k client processes at B* each: the same clients as
    `direct_count`, so the two differ by the gateway alone (`planner validate`'s one client process can itself
    be the limit on a fast GPU)."""
    s = ctx.settings
    n_requests = s.requests_for(b_star, req_s)
    ctx.log(f"{k} replica(s) through the gateway: {n_requests} requests from each of {k} clients, {b_star} at a time")
    started = time.monotonic()
    with deployer.deploy(sub_plan(plan_, k), f"clients-k{k}") as url:
        points, client = drive(ctx.out / "run" / step / f"gateway-k{k}", [url] * k,
                               client_argv(s, model, b_star, n_requests), b_star, s.request_timeout_s + 60.0)
    result = pooled(points)
    ctx.store.put(step, f"gateway-k{k}", {
        "replicas": k, "batch_size": b_star, "requests_each": n_requests, **result,
        "gpu": asdict(deployer.last_gpu) if deployer.last_gpu else None,
        "cpu_cores": {**(deployer.last_cpu or {}), "clients": client},
        "elapsed_s": round(time.monotonic() - started, 1)})
    ctx.log(f"{k} replica(s) through the gateway, {k} clients: {_tok(result)} together; clients {client:.2f} "
            f"cores, gateway {(deployer.last_cpu or {}).get('gateway', 0.0):.2f}")


def _tok(result: dict[str, Any]) -> str:
    steady = result.get("steady_tok_s")
    return f"{result['total_tok_s']:,.0f} tok/s" + (f" ({steady:,.0f} steady)" if steady is not None else "")


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Kill a client process that is still running, and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def decide(ctx: Context, step: str) -> None:
    """`planner validate`'s rule over the counts measured: the count to keep, and why (one replica if
    replication does not pay). It reads the counts driven by one client process per replica ("k clients"),
    as `planner validate` now drives them, where every count has one; else the one-client counts."""
    stored = ctx.store.all(step)
    ks = sorted(int(name[1:]) for name in stored if re.fullmatch(r"k\d+", name))
    if not ks:
        return
    by_clients = all(f"gateway-k{k}" in stored for k in ks)
    rates = {k: float(stored[f"gateway-k{k}" if by_clients else f"k{k}"]["total_tok_s"]) for k in ks}
    best = best_of(rates, ctx.settings.min_gain)
    decision = explain(rates, best, ctx.settings.min_gain)
    ctx.store.put(step, "decision", {"best_replicas": best, "decision": decision, "min_gain": ctx.settings.min_gain,
                                     "driven_by": "one client per replica" if by_clients else "one client"})
    ctx.log(f"{step}: {decision}")
