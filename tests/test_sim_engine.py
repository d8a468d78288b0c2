"""The simulated vLLM engine: batch cap, token budget, KV blocks, preemption, shared GPU, virtual time."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sim.clock import VirtualClock
from sim.device import SharedDevice
from sim.engine import FINISHED, Engine, EngineConfig, SimRequest
from sim.gpus import get_gpu
from sim.model import load_model
from sim.node import Node, NodeSpec
from sim.steptime import StepTimeModel
from sim.workload import gamma_arrivals, poisson_arrivals, sharegpt_like

MODEL = load_model("opt-1.3b")
GPU = get_gpu("H100-64GB")


class RecordingSteps(StepTimeModel):
    """Step times as usual, remembering each step's new tokens and sequences."""

    def __init__(self) -> None:
        super().__init__(MODEL, GPU)
        self.tokens: list[int] = []

    def device_s(self, new_tokens: int, sampled: int, kv_read: float, attn_pairs: float,
                 decode_kv: float | None = None) -> float:
        self.tokens.append(new_tokens)
        return super().device_s(new_tokens, sampled, kv_read, attn_pairs, decode_kv)


def engine(blocks: int = 10_000, chunked: bool = False, **limits: int) -> tuple[VirtualClock, Engine, RecordingSteps]:
    clock = VirtualClock()
    steps = RecordingSteps()
    config = EngineConfig(num_gpu_blocks=blocks, chunked_prefill=chunked, **limits)
    return clock, Engine(config, steps, SharedDevice(clock), clock), steps


def run(clock: VirtualClock, eng: Engine, sizes: list[tuple[int, int]]) -> list[SimRequest]:
    reqs = [SimRequest(p, o) for p, o in sizes]
    for req in reqs:
        eng.add(req)
    clock.run()
    return reqs


@pytest.mark.parametrize("chunked", [False, True])
def test_every_request_gets_all_its_tokens_and_blocks_come_back(chunked: bool) -> None:
    """Each request ends with exactly its output tokens; no block is left in use."""
    clock, eng, steps = engine(chunked=chunked, max_num_seqs=8)
    reqs = run(clock, eng, [(100 + i, 50 + 7 * i) for i in range(40)])
    assert all(r.state == FINISHED and r.generated == r.max_tokens for r in reqs)
    assert eng.used_blocks == 0 and eng.generated_inflight() == 0
    assert eng.generation_tokens_total == sum(r.max_tokens for r in reqs)
    # vLLM's iteration_tokens histogram: one observation per step, of the tokens the step computed
    assert eng.steps_total == len(steps.tokens) and eng.iteration_tokens_total == sum(steps.tokens)
    assert eng.iteration_tokens_total == sum(r.prompt_tokens + r.max_tokens - 1 for r in reqs)


def test_queue_time_starts_at_the_step_boundary_as_vllm_stamps_it() -> None:
    """vLLM's engine core takes in requests between steps, and its scheduler stamps them queued then: a request
    arriving during a step is queued at that step's end, and with budget to spare scheduled at once (queue time 0,
    the wait counted in its TTFT alone)."""
    clock, eng, _ = engine(chunked=True, max_num_seqs=8, max_num_batched_tokens=4096)
    first, late = SimRequest(2000, 4), SimRequest(100, 4)
    eng.add(first)
    clock.call_at(1e-4, eng.add, late)  # during the first request's prefill step
    clock.run()
    assert first.queued_at == first.scheduled_at == 0.0
    assert late.arrival == pytest.approx(1e-4)
    assert late.queued_at == late.scheduled_at > late.arrival  # the first step's end
    assert eng.queue_time == [0.0, 2]
    assert eng.prefill_time[0] == pytest.approx(sum(r.first_token_at - r.scheduled_at for r in (first, late)))


def test_batch_cap_bounds_running_requests() -> None:
    """Never more than max_num_seqs requests run; the rest wait."""
    clock, eng, _ = engine(max_num_seqs=4)
    seen: list[int] = []

    def probe() -> None:
        seen.append(eng.num_running)
        if eng.num_running or eng.num_waiting:
            clock.call_at(clock.now() + 0.001, probe)

    clock.call_at(0.0, probe)
    run(clock, eng, [(50, 100)] * 20)
    assert max(seen) == 4 and min(seen[1:-1]) > 0


def test_v0_prefill_respects_the_token_budget() -> None:
    """Without chunking, a prefill step holds whole prompts whose sum fits max_num_batched_tokens."""
    clock, eng, steps = engine(max_num_batched_tokens=2048, max_num_seqs=64)
    run(clock, eng, [(700, 5)] * 10)
    assert max(steps.tokens) == 1400  # two 700-token prompts fit, a third does not
    assert steps.tokens[0] == 1400


def test_chunked_prefill_splits_long_prompts_within_the_budget() -> None:
    """With chunking, every step's tokens (decodes + prompt chunks) stay within the budget."""
    clock, eng, steps = engine(chunked=True, max_num_batched_tokens=512, max_num_seqs=64)
    reqs = run(clock, eng, [(1500, 20)] * 4 + [(30, 40)] * 8)
    assert max(steps.tokens) <= 512 and steps.tokens.count(512) >= 10
    assert all(r.generated == r.max_tokens for r in reqs)


def test_preemption_when_blocks_run_out_and_recompute_finishes_everything() -> None:
    """A KV cache too small for the batch preempts (recompute) and still completes every request."""
    clock, eng, _ = engine(blocks=200, max_num_seqs=32)
    reqs = run(clock, eng, [(100, 400)] * 24)
    assert eng.num_preemptions > 0 and sum(r.preemptions for r in reqs) == eng.num_preemptions
    assert all(r.generated == 400 for r in reqs) and eng.used_blocks == 0
    assert eng.max_blocks_used <= 200


def test_a_request_larger_than_the_cache_is_refused() -> None:
    """prompt + max_tokens beyond the KV cache (or max_model_len) is refused with an error, not hung."""
    clock, eng, _ = engine(blocks=50)
    (req,) = run(clock, eng, [(700, 400)])
    assert req.error and "exceeds" in req.error and req.state != FINISHED


def test_abort_frees_blocks() -> None:
    """Aborting a running request frees its blocks; the others finish."""
    clock, eng, _ = engine()
    a, b = SimRequest(100, 1000), SimRequest(100, 50)
    eng.add(a)
    eng.add(b)
    clock.call_at(0.05, eng.abort, a)
    clock.run()
    assert a.state == "aborted" and b.state == FINISHED and eng.used_blocks == 0


def test_processor_sharing_device() -> None:
    """Two 1 s jobs at once both end at 2 s; a job alone takes its own time."""
    clock = VirtualClock()
    device = SharedDevice(clock)
    ends: dict[str, float] = {}
    device.submit(1.0, lambda: ends.setdefault("a", clock.now()))
    device.submit(1.0, lambda: ends.setdefault("b", clock.now()))
    clock.call_at(5.0, device.submit, 0.5, lambda: ends.setdefault("c", clock.now()))
    clock.run()
    assert ends["a"] == pytest.approx(2.0) and ends["b"] == pytest.approx(2.0) and ends["c"] == pytest.approx(5.5)
    assert device.busy_s == pytest.approx(2.5)


class BoundedClock(VirtualClock):
    """A virtual clock that fails a run of more events than anything here needs (a livelock, not a hang)."""

    def call_at(self, when: float, callback: Any, *args: Any) -> None:
        assert self.events < 100_000, f"livelock at t={self.now()!r}"
        super().call_at(when, callback, *args)


@pytest.mark.parametrize("start", [0.0, 7 * 3600.0, 90 * 86400.0])
def test_the_device_finishes_its_jobs_at_any_clock_reading(start: float) -> None:
    """A loop clock reads the host's uptime: at hours or months one ulp of it exceeds the device's rounding
    tolerance, and overlapping jobs of odd lengths still all finish, each near its processor-sharing time."""
    clock = BoundedClock(start)
    device = SharedDevice(clock)
    ends: list[float] = []
    works = [0.000123 * (k % 7 + 1) + 1e-7 * k for k in range(200)]
    for k, work in enumerate(works):
        clock.call_at(start + 0.0001 * k, device.submit, work, lambda: ends.append(clock.now()))
    clock.run()
    assert len(ends) == len(works)
    assert max(ends) - start == pytest.approx(sum(works), rel=1e-6, abs=1e-6)


def test_replicas_share_the_device_and_overlap_host_work() -> None:
    """Two replicas on one GPU: each is slower than alone, together they make more tokens/s than one."""
    specs = sharegpt_like(600, np.random.default_rng(0))

    def tokens_per_s(replicas: int) -> float:
        clock = VirtualClock()
        node = Node(NodeSpec(MODEL, GPU, replicas, 128), clock)
        reqs = [SimRequest(s.prompt_tokens, s.output_tokens) for s in specs]
        for i, req in enumerate(reqs):
            node.engines[i % replicas].add(req)
        clock.run()
        return sum(r.max_tokens for r in reqs) / max(r.finished_at for r in reqs)  # type: ignore[type-var]

    one, two = tokens_per_s(1), tokens_per_s(2)
    assert 1.15 * one < two < 2 * one


def test_arrival_processes_have_the_asked_rate_and_burstiness() -> None:
    """Poisson and gamma arrivals average the asked rate; gamma with CV 3 is burstier."""
    rng = np.random.default_rng(0)
    poisson, gamma = poisson_arrivals(20000, 10.0, rng), gamma_arrivals(20000, 10.0, 3.0, rng)
    assert 20000 / poisson[-1] == pytest.approx(10, rel=0.05) and 20000 / gamma[-1] == pytest.approx(10, rel=0.1)
    assert np.std(np.diff(gamma)) / np.mean(np.diff(gamma)) == pytest.approx(3, rel=0.15)


def test_sharegpt_like_means_follow_the_reference() -> None:
    """The lognormal mix has the reference run's means (110.6 prompt, 291.6 output) within 3%."""
    specs = sharegpt_like(20000, np.random.default_rng(0))
    assert np.mean([s.prompt_tokens for s in specs]) == pytest.approx(110.6, rel=0.03)
    assert np.mean([s.output_tokens for s in specs]) == pytest.approx(291.6, rel=0.03)
    assert max(s.prompt_tokens + s.output_tokens for s in specs) <= 2048


def test_the_virtual_loop_waits_for_executor_work_before_moving_its_clock() -> None:
    """A thread's real time is not on the virtual clock: while executor work (an HTTP client's getaddrinfo) runs,
    the clock stands still instead of jumping to the next timer."""
    import asyncio
    import time

    from sim.vloop import run

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        loop.call_later(5.0, lambda: None)  # the next timer: a jumping clock would be there by the job's end
        await loop.run_in_executor(None, time.sleep, 0.05)
        during = loop.time()
        await asyncio.sleep(1.0)
        return during, loop.time()

    assert run(main()) == (0.0, 1.0)
