"""The engines' own steps, real and simulated: is the simulator's gap in the step at a given batch, or in the batch?

Each run records vLLM's counters before and after it (`engine` in runs.jsonl): steps (the count of
`vllm:iteration_tokens_total`), tokens computed in them (its sum), tokens generated and prompt tokens. `sim serve`
counts the same. Per replica, over the run's span (first request sent to last one ended):

- **sampled a step**: tokens generated / steps, the mean number of sequences a step decodes (the engine's batch,
  as the engine saw it, where Little's law counts what the clients had in flight);
- **ms a step**: the replicas' busy time / steps, a replica busy while a request it was sent is in flight (from
  the client's sending to its last byte: `busy_s`). Runs without each request's replica and end fall back to the
  span x replicas / steps, which counts the time a replica idled between arrivals: on 2026-11-28's stored runs
  the span was 1.02-1.06 x the busy time at 80% and 95% load, 1.06 x at 50% under Poisson, 1.22 x at 50% under bursts;
- **prompt tokens computed a step**: the steps' tokens less those sampled. Not `vllm:prompt_tokens`, which counts
  whole prompts, their cached part included (2.5 x the prompt work on 2026-11-28's multi-turn chat).

Beside the real side's figures, the replica model the simulated side was calibrated with, evaluated at the real
engines' own batch and prompt tokens a step (`step(batch) + prefill x prompt tokens`, at the calibration's shorter
context): where that matches the real step, the step model holds under this load and the gap is in how many
requests the simulated engines hold; where it does not, the step model misses something this load does. For the
side that follows the machine's speed (`--follow-speed`), the model is scaled as that run's simulated twin was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sim.measured import ReplicaModel

from .common import markdown_table
from .sim_vs_real_ranking import point_of


def per_run(row: dict[str, Any], replicas: int) -> tuple[float, float, float] | None:
    """(sampled a step, ms a step, prompt tokens computed a step) of one run, per replica; None without the
    counters. Prompt tokens computed: the steps' tokens less those sampled (vLLM's iteration tokens are the
    prompt tokens computed plus the tokens sampled), not `vllm:prompt_tokens`, which counts whole prompts, the part
    found in the prefix cache included: on multi-turn chat, 2.5 x the prompt work."""
    engine = row.get("engine")
    if not engine or not engine["steps"] or not math.isfinite(engine["span_s"]):
        return None
    steps = engine["steps"]
    busy = busy_s(row)
    spent = busy if busy is not None else engine["span_s"] * replicas
    return engine["generated"] / steps, 1000 * spent / steps, (engine["tokens"] - engine["generated"]) / steps


def busy_s(row: dict[str, Any]) -> float | None:
    """Seconds the run's replicas had a request in flight, summed over replicas: per replica the union of its
    requests' [sent, sent + E2E] intervals. From `firsts` ([sent, TTFT, prompt tokens, replica] of each completed
    request) beside `e2e_s` (the same requests, in the same order); None where they do not pair up (a completed
    request without a first token, or rows from before `firsts` was recorded)."""
    firsts, e2e = row.get("firsts"), row.get("e2e_s")
    if not firsts or e2e is None or len(firsts) != len(e2e) or not all(f[3] for f in firsts):
        return None
    spans: dict[str, list[tuple[float, float]]] = {}
    for (sent, _, _, replica), took in zip(firsts, e2e):
        spans.setdefault(replica, []).append((sent, sent + took))
    total = 0.0
    for intervals in spans.values():
        intervals.sort()
        start, end = intervals[0]
        for a, b in intervals[1:]:
            if a > end:
                total += end - start
                start = a
            end = max(end, b)
        total += end - start
    return total


def model_ms(model: ReplicaModel, sampled: float, prompt: float, context: float | None = None,
             pairs: float = 0.0) -> float:
    """The replica model's step at this (mean, fractional) batch and these prompt tokens, its decoding sequences
    `context` tokens long on average (None: at the model's short profile's context), the prompt tokens' attention
    computing `pairs` (query, key) pairs."""
    return 1000 * (model.step(sampled, context) + model.prefill_s_per_token * prompt
                   + model.prefill_s_per_pair * pairs)


def pairs_a_step(row: dict[str, Any]) -> float:
    """The (query, key) pairs a step's prompt tokens attended to, estimated from each request's prompt length and
    the run's prefix-cache hit rate h: a prompt of p tokens, h x p of them cached, computes (1 - h) p tokens after
    h p, so p^2 (1 - h^2) / 2 pairs. Exact without cache hits (single-turn traffic); on multi-turn chat, where each
    turn adds about as many tokens whatever its history, 2026-11-28's chat came out about 10% high. 0 without each
    request's prompt length (`firsts`) or vLLM's step counters."""
    firsts, engine = row.get("firsts"), row.get("engine")
    if not firsts or not engine or not engine["steps"]:
        return 0.0
    hit = row.get("hit_rate")
    hit = hit if isinstance(hit, float) and math.isfinite(hit) else 0.0
    return float(sum(f[2] ** 2 for f in firsts) * (1 - hit * hit) / 2 / engine["steps"])


def decoding_context(records: Sequence[dict[str, Any]]) -> float | None:
    """The mean context of a decoding sequence over a run's steps: each request decodes `output_tokens` steps at
    contexts from its prompt to prompt + output, so the mean over all decode steps is sum(out x (prompt + out / 2))
    / sum(out). Prompt tokens as the server counted them, else as requested; None without any request."""
    pairs = [(r["output_tokens"], r.get("prompt_tokens") or r.get("requested_prompt_tokens") or 0) for r in records
             if (r.get("output_tokens") or 0) > 0]
    out = sum(o for o, _ in pairs)
    return sum(o * (p + o / 2) for o, p in pairs) / out if out else None


def twin_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a run and its twin on another side share: workload, arrivals, load, seed, policy."""
    return row["workload"], row["arrival"], row["load"], row["seed"], row["policy"]


def real_twins(rows: Sequence[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The real single-turn runs by `twin_key`, each the twin of the simulated runs with its key: the first run of
    its schedule, not a repeat of it (`--repeats` runs the real side's first run again; the simulated sides do
    not)."""
    return {twin_key(r): r for r in rows
            if r["side"] == "real" and r["workload"] != "chat" and r.get("repeat", 0) == 0}


def steps_lines(rows: Sequence[dict[str, Any]], replicas: int, sim_side: str,
                model_path: str | None = None, scaled: bool = False) -> list[str]:
    """The report's section: per point, each side's median engine batch, step and prompt tokens a step; the
    replica model at the real batch (`scaled`: times the scale the simulated twin of each real run ran at)."""
    scales = {twin_key(r): float(r["scale"]) for r in rows if scaled and r["side"] == sim_side and "scale" in r}
    cells: dict[tuple[str, str], list[tuple[float, float, float, float, float | None, float]]] = {}
    for r in rows:
        figures = per_run(r, replicas) if r["workload"] != "chat" and r["side"] in ("real", sim_side) else None
        if figures:
            scale = scales.get(twin_key(r), math.nan) if scaled else 1.0
            cells.setdefault((point_of(r), r["side"]), []).append(
                (*figures, scale, r.get("context"), pairs_a_step(r)))
    points = sorted({p for p, _ in cells})
    if not any((p, "real") in cells and (p, sim_side) in cells for p in points):
        return []
    model = ReplicaModel.load(model_path) if model_path and Path(model_path).is_file() else None
    body = []
    for point in points:
        real, sim = cells.get((point, "real")), cells.get((point, sim_side))
        if not real or not sim:
            continue
        rb, rms, rp = (float(np.median(v)) for v in list(zip(*real))[:3])
        sb, sms, sp = (float(np.median(v)) for v in list(zip(*sim))[:3])
        row = [point, len(real), f"{rb:.1f}", f"{sb:.1f}", f"{rms:.2f}", f"{sms:.2f}", f"{sms / rms - 1:+.0%}",
               f"{rp:.1f}", f"{sp:.1f}"]
        if model:
            at_real = float(np.median([scale * model_ms(model, b, p, c, n) for b, _, p, scale, c, n in real]))
            row += [f"{at_real:.2f}", f"{at_real / rms - 1:+.0%}"]
        body.append(row)
    head = ["point", "runs", "sampled a step, real", "sim", "ms a step, real", "sim", "sim / real - 1",
            "prompt tokens computed a step, real", "sim"]
    if model:
        head += ["replica model at the real batch, ms", "model / real - 1"]
    return [f"## The engines' own steps (`{sim_side}`)", "",
            "From vLLM's counters (`vllm:iteration_tokens_total`, generated and prompt tokens), per replica, medians "
            "over the runs of a point: the engines' mean batch (tokens sampled a step), the mean step (the replicas' "
            "time with a request in flight / steps; runs recorded without each request's replica: the run's span x "
            "replicas / steps) and prompt tokens computed a step (the steps' tokens less those sampled)"
            + (", and the calibrated replica model evaluated at the real engines' batch and prompt tokens a step, "
               "at each run's mean decoding context (runs before 2026-11-26's seventh session: at the short "
               "profile's)" if model else "") + ".", "", markdown_table(head, body), ""]


def step_ratio(row: dict[str, Any], replicas: int, model: ReplicaModel) -> float | None:
    """How many times slower than the replica model one run's engines stepped: its mean step over the model at its
    own batch, prompt tokens a step and decoding context (None without vLLM's counters)."""
    figures = per_run(row, replicas)
    if not figures:
        return None
    sampled, ms, prompt = figures
    return ms / model_ms(model, sampled, prompt, row.get("context"), pairs_a_step(row))


def run_scale(row: dict[str, Any], replicas: int, model_path: str) -> float:
    """`step_ratio` of one real run, for its simulated twin; an error naming the run where it has no counters."""
    ratio = step_ratio(row, replicas, ReplicaModel.load(model_path))
    if ratio is None:
        raise ValueError(f"run {row['workload']}/{row['load']:g}/{row['seed']}/{row['policy']} has no vLLM step "
                         "counters to pair its simulated twin's speed with")
    return ratio


def warmup_scale(rows: Sequence[dict[str, Any]], replicas: int, model_path: str) -> dict[str, float]:
    """Per workload, how many times slower than the replica model the real engines stepped in their seed-0 runs
    (the warm-up): the median over that workload's runs of each run's mean step over the model at its own batch,
    prompt tokens a step and decoding context. Per workload, since the model's miss depends on the lengths (on
    2026-11-27 the engines ran 1.2-1.3 x it on `mix` and 1.55 x on ShareGPT-like lengths, in the same minutes)."""
    ratios = median_step_ratios([r for r in rows if r["seed"] == 0], replicas, model_path)
    if not ratios:
        raise ValueError("no single-turn real run of seed 0 with vLLM's step counters to match the model to")
    return ratios


def median_step_ratios(rows: Sequence[dict[str, Any]], replicas: int, model_path: str, side: str = "real",
                       chat: bool = False) -> dict[str, float]:
    """Per workload (single-turn only unless `chat`), the median over `side`'s runs of `step_ratio` over the scale
    each run ran at (real runs: 1); workloads whose runs have no vLLM counters are absent."""
    model = ReplicaModel.load(model_path)
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if r["side"] == side and (chat or r["workload"] != "chat") \
                and (ratio := step_ratio(r, replicas, model)) is not None:
            ratios.setdefault(r["workload"], []).append(ratio / float(r.get("scale", 1.0)))
    return {workload: float(np.median(v)) for workload, v in sorted(ratios.items())}


def fixed_scales(rows: Sequence[dict[str, Any]], replicas: int, model_path: str, given: str) -> dict[str, float]:
    """`--fixed-speed`'s one factor per single-turn workload: `given` as a number, or "median": the median over
    every real run of that workload of its mean step over the model at its own batch (`step_ratio`, the factor
    its `--pair-steps` twin runs at)."""
    workloads = sorted({r["workload"] for r in rows if r["side"] == "real" and r["workload"] != "chat"})
    if given != "median":
        return dict.fromkeys(workloads, float(given))
    ratios = median_step_ratios(rows, replicas, model_path)
    if missing := [w for w in workloads if w not in ratios]:
        raise ValueError(f"--fixed-speed median: no real run of {', '.join(missing)} with vLLM's step counters")
    return ratios


def overcounts(rows: Sequence[dict[str, Any]], replicas: int, model_path: str, side: str) -> dict[str, float]:
    """Per workload (chat too), what `step_ratio` reads on simulated engines at scale 1 (`side`, the together
    calibration's runs), whose every step is the model's: the median over that side's runs, the reading's own bias.
    The busy time it divides by the steps also holds each request's front end and way out, where no step is under
    way, and it prices the model at a run's mean batch and context, not step by step: on 2026-12-01's runs 1.042 on
    ShareGPT-like lengths, 0.966 on `mix`. A real run's reading holds the same bias, and a twin scaled by it adds its
    own front end again (ShareGPT's paired twins ran their steps 4% slow). The scales read from real runs
    (`--pair-steps`, `--fixed-speed median`, `--match-steps`) are divided by this."""
    return median_step_ratios(rows, replicas, model_path, side, chat=True)


def net_of(scales: dict[str, float], over: dict[str, float]) -> dict[str, float]:
    """Each workload's scale over its overcount (`overcounts`); an error naming a workload without one."""
    if missing := [w for w in scales if w not in over]:
        raise ValueError(f"no simulated run at scale 1 of {', '.join(missing)} to net the step measurement of")
    return {w: s / over[w] for w, s in scales.items()}


def matched_scale(scales: float | dict[str, float], workload: str) -> float:
    """The factor `warmup_scale` found for `workload` (run directories before 2026-11-27: one for all)."""
    if isinstance(scales, dict):
        if workload not in scales:
            raise ValueError(f"no seed-0 real run of workload {workload!r} to match its steps to")
        return scales[workload]
    return scales


def speedometer_lines(rows: Sequence[dict[str, Any]], replicas: int, model_path: str | None,
                      speed_ref_us: float | None) -> list[str]:
    """Whether the speedometer (`speed_us`, bench.common.machine_speed) could stand in for the real engines' speed:
    per real single-turn run, the engines' step over the replica model at their own batch (`step_ratio`) beside the
    speedometer over its reading about the calibration. If it followed the engines, the model scaled by it would
    miss the real step by less than the model alone."""
    model = ReplicaModel.load(model_path) if model_path and Path(model_path).is_file() else None
    if model is None or not speed_ref_us:
        return []
    pairs = [(float(r["speed_us"]) / speed_ref_us, ratio) for r in rows
             if r["side"] == "real" and r["workload"] != "chat" and "speed_us" in r
             and (ratio := step_ratio(r, replicas, model)) is not None]
    if len(pairs) < 3:
        return []
    speedo, engines = (np.array(v) for v in zip(*pairs))
    alone, scaled = float(np.median(abs(engines - 1))), float(np.median(abs(engines / speedo - 1)))
    return ["## Could the speedometer stand in for the engines' speed?", "",
            f"Over the {len(pairs)} real single-turn runs: the engines stepped {engines.min():.2f}-{engines.max():.2f} "
            f"x the replica model at their own batch (median {float(np.median(engines)):.2f}); the speedometer read "
            f"{speedo.min():.2f}-{speedo.max():.2f} x its reading about the calibration (median "
            f"{float(np.median(speedo)):.2f}). Rank correlation {rank_correlation(speedo, engines):+.2f}. The median "
            f"miss of the model's step: {alone:.0%} as calibrated, {scaled:.0%} scaled by the speedometer"
            + (" (scaling helps)." if scaled < alone else " (scaling does not help)."), ""]


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (no ties expected: measured floats)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])
