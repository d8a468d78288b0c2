"""`sim calibrate --profile DIR`: a `ReplicaModel` fitted to a `planner profile` of one real replica.

The profile is a closed-loop sweep: at each batch size B, B clients each send fixed-length requests (I prompt
tokens, O output tokens) one after another. From it:

- `step(B)`: the point's median inter-token latency over the tokens a streamed chunk carried (mean ITL / mean
  TPOT), the time of a step that decodes B sequences and prefills nothing (most gaps are such steps; those
  holding a prompt chunk are the long tail), times the engine's slow steps: the median leaves out the steps that
  take longer with nothing more to do, which every token pays for on average. At B = 1 nothing else runs, so
  there the mean time per token over the median gap measures them (`slow_steps`; vLLM-CPU: 8.50 ms against
  7.66, 1% of gaps over 40 ms);
- `prefill_s_per_token`, `frontend_s` and `stream_s`: fitted (Nelder-Mead, in log space) so that the same sweep,
  replayed on the simulated replica in virtual time, gives the profile's median TTFT, mean TPOT and tokens per
  chunk at every B. The front end is one queue, in time order (vLLM's API server is one process): B requests
  sent together reach the engine `frontend_s` apart, and each chunk it streams back costs it `stream_s`; tokens
  made while their request's chunk still waits go out in that chunk. Where no tokens merged, `stream_s` starts at
  1 us and the fit does not move it far (vLLM-CPU: 1 us), though started at 600 us it fits the same sweep better
  at about 0.7 ms a chunk, and `bench.burst_probe --background` measures about 0.5 ms a stream on vLLM-CPU
  (docs/sim.md, "A prompt under streaming load"); on an H200 the API server was the limit past B = 64 and merged
  2-5 tokens a chunk;
- the scheduler's limits (`max_num_seqs`, `max_num_batched_tokens`, chunked prefill, prefix caching) from the
  profile's vLLM arguments or the command line, the KV pool (blocks, block size) from the replica's
  `vllm:cache_config_info` as the profile recorded it, `max_model_len` likewise.

Several profiles of one workload are rounds of it, taken minutes apart: each point is the round with the median TPOT
(`median_of_rounds`), so that one round caught in a fast or a slow minute of a shared machine does not set the model.

Nothing is defaulted silently: what neither the profile nor the command line gives is an error naming it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from planner.errors import PlannerError
from planner.points import Profile, ProfilePoint
from planner.sources import load_profile

from .calibrate import nelder_mead
from .clock import VirtualClock
from .engine import EngineConfig, SimRequest
from .measured import FrontEnd, ReplicaModel
from .node import MeasuredSpec


class CalibrationError(ValueError):
    """The profile lacks what the calibration needs; the message lists every missing item."""


@dataclass(frozen=True)
class EngineFacts:
    """The scheduler settings of the profiled replica: from the command line, else from the profile."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    max_model_len: int | None = None
    tokenizer: str | None = None
    model_name: str | None = None


@dataclass(frozen=True)
class PointFit:
    """One batch size: measured against simulated."""

    batch_size: int
    requests: str  # "prompt + output" tokens
    ttft_p50_ms: float
    sim_ttft_p50_ms: float
    tpot_mean_ms: float
    sim_tpot_mean_ms: float
    tokens_per_chunk: float = 1.0  # mean ITL / mean TPOT: how many tokens a streamed chunk carried
    sim_tokens_per_chunk: float = 1.0


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in a vLLM argument list."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _bool_flag(args: Sequence[str], name: str) -> bool | None:
    if f"--{name}" in args:
        return True
    if f"--no-{name}" in args:
        return False
    return None


def facts_from_profile(profile: Profile, given: EngineFacts) -> EngineFacts:
    """`given` completed from the profile's vLLM arguments (the command line wins)."""
    args = profile.context.vllm_args

    def number(name: str) -> int | None:
        value = _flag(args, name)
        return int(value) if value is not None else None

    return EngineFacts(
        max_num_seqs=given.max_num_seqs or number("--max-num-seqs"),
        max_num_batched_tokens=given.max_num_batched_tokens or number("--max-num-batched-tokens"),
        chunked_prefill=given.chunked_prefill if given.chunked_prefill is not None
        else _bool_flag(args, "enable-chunked-prefill"),
        prefix_caching=given.prefix_caching if given.prefix_caching is not None
        else _bool_flag(args, "enable-prefix-caching"),
        max_model_len=given.max_model_len or number("--max-model-len"),
        tokenizer=given.tokenizer or _tokenizer_of(profile.context.model),
        model_name=given.model_name or profile.context.model)


def _tokenizer_of(model: str | None) -> str | None:
    if model and (Path(model) / "tokenizer.json").is_file():
        return model
    return None


def check(profile: Profile, facts: EngineFacts) -> None:
    """Raise CalibrationError listing everything the calibration needs and the profile lacks."""
    missing = []
    work = profile.context.workload
    if work.kind != "fixed" or not work.input_tokens or not work.output_tokens:
        missing.append("a fixed-length workload (planner profile --input-tokens/--output-tokens), got "
                       f"{work.kind!r}")
    elif work.output_tokens < 2:
        missing.append("at least 2 output tokens per request (a time per output token)")
    for p in profile.points:
        for what, value in (("itl_ms.p50", p.itl_ms.p50), ("ttft_ms.p50", p.ttft_ms.p50),
                            ("tpot_ms.mean", p.tpot_ms.mean)):
            if not value:
                missing.append(f"B={p.batch_size}: {what}")
    if not any(p.kv_pool for p in profile.points):
        missing.append("the KV pool (vllm:cache_config_info: num_gpu_blocks, block_size)")
    for name, flag in (("max_num_seqs", "--max-num-seqs"), ("max_num_batched_tokens", "--max-num-batched-tokens"),
                       ("chunked_prefill", "--chunked-prefill/--no-chunked-prefill"),
                       ("prefix_caching", "--prefix-caching/--no-prefix-caching"),
                       ("max_model_len", "--max-model-len"), ("model_name", "--served-model-name")):
        if getattr(facts, name) is None:
            missing.append(f"{name} (not in the profile's vLLM arguments: give {flag})")
    if missing:
        raise CalibrationError(f"the profile {profile.context.source!r} cannot calibrate the simulator; "
                               "missing: " + "; ".join(missing))


def stream_start(profile: Profile) -> float:
    """Where the fit of the front end's cost per chunk starts. A front end that merges tokens streams one chunk
    per request in a round of about B chunks, while the engine makes tokens per chunk steps of TPOT: so a chunk
    costs about tokens per chunk x TPOT / B (the most merged point). No merging anywhere: 1 us."""
    guesses = [tokens_per_chunk(p) * (p.tpot_ms.mean or 0.0) / 1e3 / p.batch_size for p in profile.points
               if tokens_per_chunk(p) > 1.05]
    return max(guesses) if guesses else 1e-6


def tokens_per_chunk(point: ProfilePoint) -> float:
    """How many tokens a streamed chunk carried at this point: mean gap between chunks / mean time per token
    (every request streams the same number of tokens), at least 1."""
    itl, tpot = point.itl_ms, point.tpot_ms.mean
    return max(1.0, itl.mean / tpot) if itl.mean and tpot else 1.0


def step_of(point: ProfilePoint) -> float:
    """One decode step at the point's batch size, in seconds: the median gap between streamed chunks, over
    the tokens a chunk carries. vLLM's API server merges the tokens of several steps into one chunk when it
    cannot stream them as fast as the engine makes them (an H200 at B >= 64: 2-4 tokens a chunk); the mean
    gap over the mean time per output token counts them, since every request streams the same number of
    tokens."""
    return (point.itl_ms.p50 or 0.0) / tokens_per_chunk(point) / 1e3


def slow_steps(profile: Profile) -> float:
    """How much longer a step is on average than the median gap says: at B = 1 (one request at a time, nothing
    else to prefill or decode) the mean time per output token over the median step, at least 1; 1 without a
    B = 1 point."""
    first = profile.points[0]
    if first.batch_size != 1 or not first.tpot_ms.mean or not step_of(first):
        return 1.0
    return max(1.0, first.tpot_ms.mean / 1e3 / step_of(first))


def initial_model(profile: Profile, facts: EngineFacts) -> ReplicaModel:
    """Step times from the median gaps (per token) and the slow steps; prefill cost and front-end latency from the
    smallest B's TTFT."""
    pool = next(p.kv_pool for p in reversed(profile.points) if p.kv_pool)
    assert pool is not None and facts.max_num_seqs and facts.max_num_batched_tokens and facts.max_model_len
    slow = slow_steps(profile)
    steps = tuple((p.batch_size, step_of(p) * slow) for p in profile.points)
    first = profile.points[0]
    prompt = profile.context.workload.input_tokens or 1
    rest = max((first.ttft_ms.p50 or 0) / 1e3 - steps[0][1], 1e-4)
    return ReplicaModel(
        model_name=str(facts.model_name), step_s=steps, prefill_s_per_token=rest / 2 / prompt, frontend_s=rest / 2,
        stream_s=stream_start(profile),
        max_num_seqs=facts.max_num_seqs, max_num_batched_tokens=facts.max_num_batched_tokens,
        chunked_prefill=bool(facts.chunked_prefill), prefix_caching=bool(facts.prefix_caching),
        block_size=pool.block_size, num_blocks=pool.num_blocks, max_model_len=facts.max_model_len,
        tokenizer=facts.tokenizer, kv_bytes_per_token=pool.bytes_per_token or 0.0,
        source={"profile": profile.context.source, "device": profile.context.device,
                "workload": f"{prompt} prompt + {profile.context.workload.output_tokens} output tokens, closed loop",
                "step_s": "median inter-token latency at each batch size, over the tokens a streamed chunk "
                          f"carries (mean ITL / mean TPOT), times {slow:.3f}: the slow steps, the mean time per "
                          "token at B = 1 over its median gap",
                "prefill_s_per_token, frontend_s": "fitted: the sweep replayed in virtual time"})


def engine_config(model: ReplicaModel) -> EngineConfig:
    return MeasuredSpec(model).engine_config()


def replay(model: ReplicaModel, batch_size: int, requests: int, prompt: int, output: int) -> tuple[float, float]:
    """(median TTFT s, mean TPOT s) of the closed-loop point replayed on the simulated replica in virtual time."""
    ttft, tpot, _ = replay_point(model, batch_size, requests, prompt, output)
    return ttft, tpot


def replay_point(model: ReplicaModel, batch_size: int, requests: int, prompt: int,
                 output: int) -> tuple[float, float, float]:
    """`replay`, and the tokens a streamed chunk carried on average (as mean ITL / mean TPOT measures it)."""
    clock = VirtualClock()
    engine = MeasuredSpec(model).build(clock)[2][0]
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    chunks: dict[int, int] = {}
    done: list[SimRequest] = []
    left = [requests]
    frontend = FrontEnd.of_model(engine, model)
    streamed = frontend.streams_at_cost  # tokens pass the front end one by one (else: at the engine's times)

    def send() -> None:
        if left[0] <= 0:
            return
        left[0] -= 1
        req = SimRequest(prompt, output, on_finish=finish, on_token=token if streamed else None)
        sent[req.rid] = clock.now()
        clock.call_at(frontend.admit(clock.now()), engine.add, req)

    def token(req: SimRequest, n: int) -> None:
        at = frontend.deliver(clock.now(), req.rid)
        first.setdefault(req.rid, at)
        if last.get(req.rid) != at:
            chunks[req.rid] = chunks.get(req.rid, 0) + 1
        last[req.rid] = at

    def finish(req: SimRequest) -> None:
        done.append(req)
        if not streamed:
            first[req.rid], last[req.rid] = req.first_token_at or 0.0, req.finished_at or 0.0
            send()
            return
        frontend.forget(req.rid)
        clock.call_at(last[req.rid], send)  # the client sends its next request once the last token is in

    for _ in range(min(batch_size, requests)):
        send()
    clock.run()
    ttfts = [first[r.rid] - sent[r.rid] for r in done]
    tpots = [(last[r.rid] - first[r.rid]) / (output - 1) for r in done]
    gaps = [(last[r.rid] - first[r.rid]) / (chunks.get(r.rid, output) - 1) for r in done
            if chunks.get(r.rid, output) > 1]
    tpot = statistics.fmean(tpots)
    per_chunk = statistics.fmean(gaps) / tpot if gaps and tpot > 0 else 1.0
    return statistics.median(ttfts), tpot, max(1.0, per_chunk)


def compare(model: ReplicaModel, profile: Profile) -> list[PointFit]:
    work = profile.context.workload
    rows = []
    for p in profile.points:
        ttft, tpot, per_chunk = replay_point(model, p.batch_size, p.num_requests or max(32, 4 * p.batch_size),
                                             work.input_tokens or 1, work.output_tokens or 2)
        rows.append(PointFit(p.batch_size, f"{work.input_tokens} + {work.output_tokens}", p.ttft_ms.p50 or 0.0,
                             ttft * 1e3, p.tpot_ms.mean or 0.0, tpot * 1e3, tokens_per_chunk(p), per_chunk))
    return rows


def _error(rows: Sequence[PointFit]) -> float:
    """Squared log errors of TTFT, TPOT and tokens per chunk (which pins the front end's cost per chunk)."""
    def log_ratio(sim: float, real: float) -> float:
        return math.log(max(sim, 1e-9) / max(real, 1e-9))  # a model that sends all at once is far off, not NaN

    return float(np.mean([log_ratio(r.sim_ttft_p50_ms, r.ttft_p50_ms) ** 2 +
                          log_ratio(r.sim_tpot_mean_ms, r.tpot_mean_ms) ** 2 +
                          log_ratio(r.sim_tokens_per_chunk, r.tokens_per_chunk) ** 2 for r in rows]))


def _load(path: str | Path, given: EngineFacts) -> Profile:
    try:
        profile = load_profile(path)
    except PlannerError as exc:
        raise CalibrationError(str(exc)) from None
    check(profile, facts_from_profile(profile, given))
    return profile


def _context(profile: Profile) -> float:
    """The mean length of a decoding sequence in the profile's requests."""
    work = profile.context.workload
    return (work.input_tokens or 0) + (work.output_tokens or 0) / 2


def median_round(tpots: Sequence[float]) -> int:
    """Which of a point's rounds is the median by TPOT mean (the lower middle of an even count; ties in round
    order)."""
    return sorted(range(len(tpots)), key=tpots.__getitem__)[(len(tpots) - 1) // 2]


def median_of_rounds(rounds: Sequence[Profile]) -> Profile:
    """Rounds of one profile (the same workload and batch sizes, taken minutes apart) as one profile: at each batch
    size, the round whose TPOT mean is the median (the lower middle of an even count), whole, so that the point's
    TTFT, TPOT and ITL stay one measurement's. A round caught in a fast or a slow minute of a shared machine is
    outvoted point by point."""
    first = rounds[0]
    sizes = [p.batch_size for p in first.points]
    for other in rounds[1:]:
        if other.context.workload != first.context.workload or [p.batch_size for p in other.points] != sizes:
            raise CalibrationError(f"{other.context.source!r} is not a round of {first.context.source!r}: give "
                                   f"rounds of one profile the same workload and batch sizes")
    if len(rounds) == 1:
        return first
    points = []
    for k in range(len(sizes)):
        points.append(rounds[median_round([r.points[k].tpot_ms.mean or 0.0 for r in rounds])].points[k])
    return Profile(tuple(points), replace(first.context, source=" + ".join(r.context.source for r in rounds)))


def _grouped(profiles: Sequence[Profile]) -> list[Profile]:
    """The profiles by workload, in the order each workload first comes, every group's rounds as one."""
    groups: dict[object, list[Profile]] = {}
    for profile in profiles:
        groups.setdefault(profile.context.workload, []).append(profile)
    return [median_of_rounds(group) for group in groups.values()]


def _prefill_fit(path: str | Path, name: str) -> float | None:
    """`fit.<name>` of `bench.prefill_cost`'s JSON at `path` (None where it is not a number); a file that cannot be
    read or is not JSON is an error naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CalibrationError(f"cannot read the prefill cost {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{str(path)!r} is not JSON: {exc}") from None
    value = data.get("fit", {}).get(name) if isinstance(data, dict) else None
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)


def prefill_pair_cost(path: str | Path) -> float:
    """The seconds per (query, key) pair of a prefill's attention that `bench.prefill_cost` measured (its JSON)."""
    value = _prefill_fit(path, "per_pair_s")
    if value is None:
        raise CalibrationError(f"{str(path)!r} has no fit.per_pair_s (write it with `python -m bench.prefill_cost "
                               f"--out`)")
    if value < 0:
        raise CalibrationError(f"{str(path)!r}: fit.per_pair_s is {value:g}; a prefill cannot get cheaper with the "
                               f"context it attends to, so its readings are noise: measure it again")
    return value


def prefill_token_cost(path: str | Path) -> float:
    """The seconds per prompt token that `bench.prefill_cost` measured (its JSON's fit.per_token_s)."""
    value = _prefill_fit(path, "per_token_s")
    if value is None or not value > 0:
        raise CalibrationError(f"{str(path)!r} has no positive fit.per_token_s (write it with `python -m "
                               f"bench.prefill_cost --out`)")
    return value


def net_steps(model: ReplicaModel, profiles: Sequence[Profile]) -> ReplicaModel:
    """`model` with each table's steps scaled point by point so that its profile, replayed, gives the profile's
    TPOT means: what remains of a measured step once the work the model charges apart (a request's core work)
    is taken out of it. The first profile sets `step_s`, a second one `long_step_s`."""
    tables = []
    for table, profile in zip((model.step_s, model.long_step_s), profiles):
        rows = compare(model, profile)
        tables.append(tuple((b, s * r.tpot_mean_ms / r.sim_tpot_mean_ms) for (b, s), r in zip(table, rows)))
    return replace(model, step_s=tables[0], long_step_s=tables[1] if len(tables) > 1 else model.long_step_s)


def fit_core_work(start: ReplicaModel, profiles: Sequence[Profile], rest: float,
                  iters: int) -> tuple[ReplicaModel, list[PointFit]]:
    """`calibrate(core_work=True)`: the prefill per token as `start` has it (measured), the front end and the
    further core work a request fitted to the profiles' TTFTs, the steps netted of that work (`net_steps`), in
    three turns (on vLLM-CPU's profiles the steps moved under 0.5% in the last). `rest`: the smallest B's TTFT
    less its step and its prefill, where the search starts (a quarter of it as front end, the rest as core work)."""
    model = start
    x = np.array([rest / 4 * 1e3, rest * 3 / 4 * 1e3])
    for _ in range(3):
        model = net_steps(model, profiles)
        base = model

        def model_of(x: np.ndarray, base: ReplicaModel = base) -> ReplicaModel:
            return replace(base, frontend_s=abs(float(x[0])) * 1e-3, frontend_core_s=abs(float(x[1])) * 1e-3)

        def loss(x: np.ndarray) -> float:
            return _error([r for p in profiles for r in compare(model_of(x), p)])

        x = nelder_mead(loss, x, x * 0.3 + 1e-3, iters)
        model = model_of(x)
    model = net_steps(model, profiles)
    source = {**model.source, "frontend_s, frontend_core_s": "fitted: the sweep replayed in virtual time, the steps "
              "netted of the core work (sim.fromprofile.net_steps)", "prefill_s_per_token": "measured"}
    if len(profiles) == 2:
        source["long_step_s"] = "the long profile's TPOT means, netted of the core work"
    return replace(model, source=source), [r for p in profiles for r in compare(model, p)]


def calibrate(profile_dir: str | Path, given: EngineFacts = EngineFacts(), iters: int = 40,
              extra: Sequence[str | Path] = (), frontend_on_core: bool = False,
              prefill_cost: str | Path | None = None,
              frontend_latency: bool = False, core_work: bool = False,
              way_out: tuple[float, float] | None = None) -> tuple[ReplicaModel, list[PointFit]]:
    """The fitted replica model and its point-by-point comparison with the profile(s).

    `extra`: more profiles of the same replica. One with the first's workload is another round of it (see
    `median_of_rounds`); one with longer requests (and its own rounds) has its steps (one per batch size) fitted
    too, and makes a step grow with the decoding sequences' context. `frontend_on_core`: the profiled replica's
    API server shared its engine's core (a CPU replica on one core); the fit replays the sweep so. `prefill_cost`:
    `bench.prefill_cost`'s JSON for that replica, whose cost per (query, key) pair of a prefill's attention the
    model takes as measured (the fit then prices the profiles' prompts with it, and fits the rest per token).
    `frontend_latency`: fit the front end as serial work per request plus a latency requests spend side by side
    (`ReplicaModel.frontend_latency_s`). The latency is what the smallest B's time to its first token leaves,
    less its step, the serial work and the prefill, so that point holds by construction and the search stays
    in three dimensions; it starts from 1/8 of that time as serial work and 1/8 as prefill, since a GPU prefills
    a short prompt in a fraction of the way there (the H200 runs: 16 ms to the first token, a prefill of 256
    tokens about 2 ms).
    `core_work`: a CPU replica whose processes share one core (implies `frontend_on_core`): each request takes
    the core for its front end and then for more work (`ReplicaModel.frontend_core_s`); the prefill per token is
    taken as `prefill_cost` measured it, and the steps are netted of the core work (`fit_core_work`).
    `way_out`: each streamed chunk's latency past vLLM's TTFT stamp and its growth per other stream, in seconds,
    as measured (`ReplicaModel.way_out_s`): taken as given, and the rest fitted with it in the replay.
    """
    if core_work and frontend_latency:
        raise CalibrationError("give --core-work or --frontend-latency, not both")
    if core_work and prefill_cost is None:
        raise CalibrationError("--core-work takes the prefill per token as measured: give --prefill-cost FILE")
    frontend_on_core = frontend_on_core or core_work
    groups = _grouped([_load(path, given) for path in (profile_dir, *extra)])
    if len(groups) > 2:
        raise CalibrationError("give profiles of at most two workloads: one with short requests, one with long "
                               "ones (several profiles of one workload are rounds)")
    profile = groups[0]
    start = replace(initial_model(profile, facts_from_profile(profile, given)), frontend_on_core=frontend_on_core)
    if way_out is not None:
        if min(way_out) < 0:
            raise CalibrationError(f"the way out must be >= 0 seconds, got {way_out}")
        start = replace(start, way_out_s=way_out[0], way_out_per_stream_s=way_out[1],
                        source={**start.source, "way_out_s, way_out_per_stream_s": "given (--way-out)"})
    if prefill_cost is not None:
        start = replace(start, prefill_s_per_pair=prefill_pair_cost(prefill_cost),
                        source={**start.source, "prefill_s_per_pair": f"measured: {prefill_cost} (bench.prefill_cost)"})
        if core_work:
            start = replace(start, prefill_s_per_token=prefill_token_cost(prefill_cost))
    prompt = profile.context.workload.input_tokens or 1
    # The smallest B's TTFT less its step and its prompt's attention pairs (measured, where given): what the front
    # end and the prefill per token share.
    rest = max((profile.points[0].ttft_ms.p50 or 0) / 1e3 - start.step_s[0][1]
               - start.prefill_s_per_pair * prompt * (prompt + 1) / 2, 1e-4)
    if frontend_latency:
        start = replace(start, frontend_s=rest / 8, prefill_s_per_token=rest / 8 / prompt)
    profiles = [profile]
    if len(groups) == 2:
        long = groups[1]
        if _context(long) <= _context(profile):
            raise CalibrationError(f"the second profile ({long.context.source!r}) must have longer requests than "
                                   f"the first ({_context(long):.0f} against {_context(profile):.0f} tokens)")
        start = replace(start, step_context=_context(profile), long_context=_context(long),
                        long_step_s=tuple((p.batch_size, (p.tpot_ms.mean or 1.0) / 1e3) for p in long.points))
        profiles.append(long)
    if core_work:
        rest = max(rest - start.prefill_s_per_token * prompt, 1e-3)
        return fit_core_work(start, profiles, rest, iters * len(profiles))

    def model_of(x: np.ndarray) -> ReplicaModel:
        longs = tuple((b, abs(float(v)) * 1e-3 + 1e-5) for (b, _), v in zip(start.long_step_s, x[3:]))
        per_token, serial = abs(float(x[0])) * 1e-6, abs(float(x[1])) * 1e-3
        latency = max(0.0, rest - serial - per_token * prompt) if frontend_latency else 0.0
        return replace(start, prefill_s_per_token=per_token, frontend_s=serial, stream_s=abs(float(x[2])) * 1e-6,
                       frontend_latency_s=latency, long_step_s=longs)

    x0 = np.array([start.prefill_s_per_token * 1e6, start.frontend_s * 1e3, start.stream_s * 1e6,
                   *(s * 1e3 for _, s in start.long_step_s)])
    def loss(x: np.ndarray) -> float:
        model = model_of(x)
        # With a latency, serial work and prefill past the smallest B's time to its first token leave none for it:
        # priced, so that the search walks back rather than resting on the edge.
        over = max(0.0, model.frontend_s + model.prefill_s_per_token * prompt - rest) / rest if frontend_latency \
            else 0.0
        return _error([r for p in profiles for r in compare(model, p)]) + 10 * over * over

    best = nelder_mead(loss, x0, x0 * 0.3 + 1e-3, iters * len(profiles))
    fitted = model_of(best)
    if len(profiles) == 2:
        fitted = replace(fitted, source={**fitted.source, "long_profile": profiles[1].context.source,
                                         "long_step_s": "fitted: the long profile replayed in virtual time"})
    return fitted, [r for p in profiles for r in compare(fitted, p)]


def format_fit(model: ReplicaModel, rows: Sequence[PointFit]) -> str:
    where = " (on the engine's core)" if model.frontend_on_core else ""
    lines = [f"step(B) at {model.step_context:.0f} tokens of context: " +
             ", ".join(f"{b}: {s * 1e3:.2f} ms" for b, s in model.step_s)]
    if model.long_step_s:
        lines.append(f"step(B) at {model.long_context:.0f} tokens: " +
                     ", ".join(f"{b}: {s * 1e3:.2f} ms" for b, s in model.long_step_s))
    lines += [
             f"prefill: {model.prefill_s_per_token * 1e6:.1f} us/token ({model.prefill_tokens_s:,.0f} tokens/s)"
             + (f" + {model.prefill_s_per_pair * 1e9:.1f} ns a (query, key) pair of its attention"
                if model.prefill_s_per_pair else "") + "; "
             f"front end: {model.frontend_s * 1e3:.1f} ms a request{where}"
             + (f" then {model.frontend_core_s * 1e3:.1f} ms more of the core" if model.frontend_core_s else "")
             + (f" + {model.frontend_latency_s * 1e3:.1f} ms of latency side by side"
                if model.frontend_latency_s else "") + f", {model.stream_s * 1e6:.0f} us a streamed chunk"
             + (f"; way out: {model.way_out_s * 1e3:.1f} ms + {model.way_out_per_stream_s * 1e3:.2f} ms a stream"
                if model.way_out_s or model.way_out_per_stream_s else ""),
             f"max_num_seqs {model.max_num_seqs}, max_num_batched_tokens {model.max_num_batched_tokens}, "
             f"chunked prefill {model.chunked_prefill}, prefix caching {model.prefix_caching}, "
             f"{model.num_blocks} blocks of {model.block_size} tokens, max_model_len {model.max_model_len}",
             "", "| tokens | B | TTFT p50 ms real | sim | error | TPOT mean ms real | sim | error | "
                 "tokens a chunk real | sim |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.requests} | {r.batch_size} | {r.ttft_p50_ms:.1f} | {r.sim_ttft_p50_ms:.1f} | "
                     f"{r.sim_ttft_p50_ms / r.ttft_p50_ms - 1:+.1%} | {r.tpot_mean_ms:.2f} | "
                     f"{r.sim_tpot_mean_ms:.2f} | {r.sim_tpot_mean_ms / r.tpot_mean_ms - 1:+.1%} | "
                     f"{r.tokens_per_chunk:.2f} | {r.sim_tokens_per_chunk:.2f} |")
    return "\n".join(lines)
