"""`planner profile` against the FAKE replica (fast): timing, concurrency, metrics, resume, dry run, failures."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.process import ManagedProcess, ProcessDied
from planner.cli import main
from planner.client import LoadResult, RequestResult
from planner.errors import PlannerError, RunError
from planner.gpu import GpuSampler
from planner.points import ProfileContext, Workload
from planner.profiler import ProfileConfig, Profiler
from planner.servers import LaunchedServer, RunningServer
from deploy.ports import free_ports
from planner.sources import load_profile, point_path
from planner.stats import summarize
from planner.vllm_metrics import parse_metrics
from planner.workload import ApproximatePrompts, FixedLengths
from tests.fake_nvml import FakeNvml
from tests.fake_replica import STATS, FakeBehavior, make_app

DATA = Path(__file__).resolve().parent / "data"


def profiler(tmp_path: Path, url: str, gpu: GpuSampler | None = None, **config: Any) -> Profiler:
    config.setdefault("warmup_requests", 1)
    sweep = ProfileConfig(out=tmp_path / "prof", model_name="fake-model", metrics_interval_s=0.02, **config)
    workload = FixedLengths(16, 8, ApproximatePrompts())
    context = ProfileContext(model="fake-model", device="cpu", workload=workload.describe())
    return Profiler(sweep, RunningServer(url), workload, context, gpu, out=lambda line: None)


async def test_point_holds_b_requests_in_flight_and_times_them(aiohttp_server: Any, tmp_path: Path) -> None:
    """B=4: the fake sees at most 4 concurrent requests; TTFT and TPOT reflect its pacing."""
    server = await aiohttp_server(make_app(FakeBehavior(ttft_s=0.02, itl_s=0.005)))
    url = str(server.make_url("")).rstrip("/")
    point = await profiler(tmp_path, url, num_requests=12).measure(url, 4)
    stats = server.app[STATS]
    assert stats.max_running == 4
    assert stats.finished == 12 + 1  # the measured requests and one warm-up
    assert all(body["max_tokens"] == 8 and body["ignore_eos"] and body["stream"] for body in stats.bodies)
    assert (point.batch_size, point.num_requests, point.failed_requests) == (4, 12, 0)
    assert point.ttft_ms.p50 is not None and point.ttft_ms.p50 >= 20
    assert point.tpot_ms.mean is not None and point.tpot_ms.mean >= 5
    assert point.e2e_ms.mean is not None and point.e2e_ms.mean >= 20 + 7 * 5
    assert point.output_tok_s is not None and point.total_tok_s > point.output_tok_s > 0
    assert point.preemptions == 0  # the fake exports vllm:num_preemptions_total
    assert point.peak_kv_usage is not None
    assert point.mean_running is not None and 0 < point.mean_running <= 4  # the engine's batch, not the client's
    assert point.metrics_missed == 0
    assert point.gpu is None  # no GPU: absent, not zero


async def test_a_point_past_100_requests_holds_them_all_at_the_replica(aiohttp_server: Any, tmp_path: Path) -> None:
    """B=160: all 160 reach the fake at once, every /metrics scrape is answered meanwhile, and the client's own
    CPU is read. aiohttp's default session holds 100 connections: the profiles of 2026-11-26..29 kept 100 requests
    at the replica at "B = 256" and timed the other 156's wait for a connection as their TTFT
    (planner.client.load_session). The fake's first token takes 1 s, so that the batch's ramp and tail, whose length
    is the client's (its CPU, under the rest of the machine's load: a mean of 95 with 0.6 s, once), stay a small part
    of the point."""
    server = await aiohttp_server(make_app(FakeBehavior(ttft_s=1.0, itl_s=0.005)))
    url = str(server.make_url("")).rstrip("/")
    point = await profiler(tmp_path, url, num_requests=320, warmup_requests=0).measure(url, 160)
    assert server.app[STATS].max_running == 160
    assert point.client_cores is not None and point.client_cores > 0  # what streaming them cost this process
    assert (point.num_requests, point.failed_requests, point.metrics_missed) == (320, 0, 0)
    assert point.mean_running is not None and point.mean_running > 100


async def test_a_point_can_be_sent_from_several_client_processes(aiohttp_server: Any, tmp_path: Path) -> None:
    """--client-processes 2 at B=8: two child processes of 4 in flight each, 8 at the fake at once, every request
    once; this process keeps scraping /metrics meanwhile, and the children's CPU is the client's."""
    server = await aiohttp_server(make_app(FakeBehavior(ttft_s=0.2, itl_s=0.005)))
    url = str(server.make_url("")).rstrip("/")
    point = await profiler(tmp_path, url, num_requests=24, warmup_requests=0, client_processes=2).measure(url, 8)
    assert server.app[STATS].max_running == 8 and server.app[STATS].finished == 24
    assert (point.num_requests, point.failed_requests, point.metrics_missed) == (24, 0, 0)
    assert point.mean_running is not None and point.mean_running > 0
    assert point.client_cores is not None and point.client_cores > 0  # the children's CPU


async def test_by_default_each_point_warms_up_with_one_round_of_new_prompts(aiohttp_server: Any,
                                                                           tmp_path: Path) -> None:
    """Without --warmup, the point at B first sends B requests together (a replica's first round at a new batch size
    is slower than the rounds after it); the next point's warm-up prompts are new too, so a prefix cache cannot
    answer them. An explicit --warmup still sets the count."""
    server = await aiohttp_server(make_app(FakeBehavior(ttft_s=0.01, itl_s=0.001)))
    url = str(server.make_url("")).rstrip("/")
    sweep = profiler(tmp_path, url, num_requests=4, warmup_requests=None)
    await sweep.measure(url, 3)
    stats = server.app[STATS]
    assert stats.finished == 3 + 4 and stats.max_running == 3
    first = {body["prompt"] for body in stats.bodies}
    await sweep.measure(url, 5)
    assert stats.finished == 3 + 4 + 5 + 4
    assert len({body["prompt"] for body in stats.bodies} - first) == 5 + 4  # the second point's warm-up: all new
    assert [ProfileConfig(out=tmp_path).warmup_for(b) for b in (1, 16)] == [1, 16]
    assert ProfileConfig(out=tmp_path, warmup_requests=2).warmup_for(16) == 2
    with pytest.raises(PlannerError, match="--warmup must be >= 0"):
        ProfileConfig(out=tmp_path, warmup_requests=-1)


async def test_another_prompt_seed_sends_other_prompts(aiohttp_server: Any, tmp_path: Path) -> None:
    """A replica profiled twice keeps the first profile's prompts in its prefix cache: `prompt_seed` makes the second
    profile's prompts (warm-up included) all different, and the same seed the same ones again."""
    server = await aiohttp_server(make_app(FakeBehavior(ttft_s=0.001, itl_s=0.001)))
    url = str(server.make_url("")).rstrip("/")
    sent = []
    for seed in (0, 1, 0):
        await profiler(tmp_path / str(len(sent)), url, num_requests=6, prompt_seed=seed).measure(url, 2)
        sent.append({body["prompt"] for body in server.app[STATS].bodies} - set().union(*sent))
    assert len(sent[0]) == 6 + 1 and len(sent[1]) == 6 + 1  # measured and warm-up, each new
    assert not sent[2]  # seed 0 again: nothing it sent was new
    with pytest.raises(PlannerError, match="prompt-seed"):
        ProfileConfig(out=tmp_path, prompt_seed=-1)


async def test_gpu_samples_come_from_nvml_when_there_is_a_gpu(aiohttp_server: Any, tmp_path: Path) -> None:
    """With a (fake) NVML the point carries utilization, memory, power and clock summaries."""
    server = await aiohttp_server(make_app(FakeBehavior(itl_s=0.01)))
    url = str(server.make_url("")).rstrip("/")
    sampler = GpuSampler(FakeNvml(utilization=(40, 60)), interval_s=0.01)
    point = await profiler(tmp_path, url, gpu=sampler, num_requests=4).measure(url, 2)
    assert point.gpu is not None and point.gpu.samples >= 2
    assert point.gpu.name == "Fake H100" and point.gpu.memory_total_bytes == 80 * 2**30
    assert point.gpu.utilization_max_pct == 60 and 40 <= (point.gpu.utilization_mean_pct or 0) <= 60
    assert point.gpu.power_mean_w == 300.0 and point.gpu.sm_clock_mean_mhz is None  # clock "not supported"
    assert point.gpu.sm_active_mean_pct is None  # no GPM metrics on this (fake) GPU: absent, not zero


def test_sm_activity_comes_from_gpm_where_nvml_has_it() -> None:
    """On a GPU with NVML's GPM metrics the sampler records SM activity and occupancy; GPM samples are freed."""
    from tests.fake_nvml import FakeNvmlWithGpm

    nvml = FakeNvmlWithGpm(sm_active=62.5, occupancy=31.0)
    sampler = GpuSampler(nvml, interval_s=0.01)
    samples = [sampler.sample() for _ in range(3)]
    assert [(s.sm_active_pct, s.sm_occupancy_pct) for s in samples] == [(62.5, 31.0)] * 3
    sampler.start()
    time.sleep(0.1)
    summary = sampler.stop()
    assert summary.samples >= 1 and summary.sm_active_mean_pct == 62.5 and summary.sm_occupancy_mean_pct == 31.0
    assert nvml.allocated - nvml.freed == 1  # only the latest sample is held


def test_vllm_metrics_page_is_parsed() -> None:
    """A real vLLM 0.32 CPU /metrics page yields usage, preemptions and the KV pool from cache_config_info."""
    snapshot = parse_metrics((DATA / "vllm-cpu-0.32-metrics.txt").read_text())
    assert snapshot.kv_usage == 0.0 and snapshot.preemptions == 0.0 and snapshot.running == 0.0
    assert snapshot.kv_pool is not None
    assert (snapshot.kv_pool.num_blocks, snapshot.kv_pool.block_size, snapshot.kv_pool.bytes) == (4096, 128, 2**30)
    assert snapshot.kv_pool.bytes_per_token == 2048.0


def test_summary_rates_are_over_wall_time_and_skip_failures() -> None:
    """Tokens/s divide by first-start-to-last-end; failed requests count but add no tokens or latencies."""
    results = (RequestResult(0.0, 1.0, ttft_s=0.1, gaps_s=(0.3, 0.3, 0.3), prompt_tokens=10, output_tokens=4),
               RequestResult(0.5, 2.0, ttft_s=0.5, gaps_s=(0.5, 0.5), prompt_tokens=10, output_tokens=3),
               RequestResult(0.5, 0.6, error="HTTP 500"))
    s = summarize(LoadResult(results, concurrency=2))
    assert (s.num_requests, s.failed_requests, s.duration_s) == (3, 1, 2.0)
    assert (s.output_tok_s, s.total_tok_s, s.req_s) == (3.5, 13.5, 1.0)
    assert s.tpot_ms.mean == pytest.approx((300.0 + 500.0) / 2)
    assert s.ttft_ms.mean == pytest.approx(300.0) and s.e2e_ms.p50 == pytest.approx(1250.0)


def test_steady_rate_counts_the_tokens_between_the_first_end_and_the_last_start() -> None:
    """A closed loop of 2 over 4 requests: the window is [2, 3) s, from A's end to D's start. In it: A's last
    chunk (1 token), B's third chunk (2 tokens: 8 over 4 chunks), C's prompt and first token (10 + 1); chunks at
    3.0 fall outside. A failed request ending first does not open the window early."""
    results = (RequestResult(0.0, 2.0, ttft_s=1.0, gaps_s=(0.5, 0.5), prompt_tokens=10, output_tokens=3),
               RequestResult(0.0, 3.0, ttft_s=1.2, gaps_s=(0.6, 0.6, 0.6), prompt_tokens=10, output_tokens=8),
               RequestResult(2.0, 4.0, ttft_s=0.5, gaps_s=(0.5,), prompt_tokens=10, output_tokens=2),
               RequestResult(3.0, 5.0, ttft_s=0.5, prompt_tokens=10, output_tokens=1))
    s = summarize(LoadResult(results, concurrency=2))
    assert (s.steady_tok_s, s.steady_s) == (14.0, 1.0)
    failed_first = (RequestResult(0.0, 0.1, error="HTTP 500"), *results)
    assert summarize(LoadResult(failed_first, concurrency=2)).steady_s == 1.0
    one_wave = summarize(LoadResult(results[:2], concurrency=2))
    assert (one_wave.steady_tok_s, one_wave.steady_s) == (None, None)


@pytest.fixture
def fake_url(tmp_path: Path) -> Iterator[str]:
    """A FAKE replica in its own process (the CLI runs its own event loop)."""
    port = free_ports()
    argv = [sys.executable, "-m", "tests.fake_replica", "--port", str(port), "--itl", "0.002"]
    with ManagedProcess("fake", argv, tmp_path / "fake.log", f"http://127.0.0.1:{port}/health",
                        startup_timeout_s=30):
        yield f"http://127.0.0.1:{port}"


def run_cli(*args: str) -> int:
    return main(["profile", *args, "--input-tokens", "8", "--output-tokens", "4", "--metrics-interval", "0.05"])


def test_cli_writes_one_file_per_point_and_a_rerun_skips_them(fake_url: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Each B gets a point file; rerunning with one more B measures only that one."""
    out = tmp_path / "prof"
    assert run_cli("--url", fake_url, "--out", str(out), "--batch-sizes", "1,4", "--num-requests", "8") == 0
    first = point_path(out, 1).stat().st_mtime_ns
    assert run_cli("--url", fake_url, "--out", str(out), "--batch-sizes", "1,4,8", "--num-requests", "8") == 0
    printed = capsys.readouterr().out
    assert f"B=1: done already ({point_path(out, 1)}), skipped" in printed
    assert "B=8: 8 requests, 8 at a time" in printed and "B=1: 8 requests" not in printed.split("skipped")[-1]
    assert point_path(out, 1).stat().st_mtime_ns == first
    profile = load_profile(out)
    assert [p.batch_size for p in profile.points] == [1, 4, 8]
    assert profile.context.model == "fake-model" and profile.context.workload == Workload("fixed", 8, 4)


def test_cli_dry_run_prints_the_runs_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run names each launch with --max-num-seqs B and touches no file."""
    out = tmp_path / "prof"
    assert run_cli("--model", "/models/m", "--out", str(out), "--batch-sizes", "2,16", "--dry-run",
                   "--vllm-args", "--dtype half", "--port", "9555") == 0
    printed = capsys.readouterr().out
    assert "B=2: would launch" in printed and "--max-num-seqs 2 --dtype half" in printed
    assert "--port 9555 --max-num-seqs 16" in printed and "then send 64 requests, 16 at a time" in printed
    assert not out.exists()


def test_cli_bad_url_and_bad_batch_sizes_are_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A non-URL, a duplicate batch size and no client process are named, exit 2."""
    assert run_cli("--url", "localhost:8000", "--out", str(tmp_path)) == 2
    assert "--url 'localhost:8000' is not an http(s) URL" in capsys.readouterr().err
    assert run_cli("--url", "http://x", "--out", str(tmp_path), "--batch-sizes", "2,2", "--dry-run") == 2
    assert "batch sizes are listed twice" in capsys.readouterr().err
    assert run_cli("--url", "http://x", "--out", str(tmp_path), "--client-processes", "0", "--dry-run") == 2
    assert "--client-processes must be >= 1, got 0" in capsys.readouterr().err


class DyingServers:
    """A replica source whose server dies at startup for B >= 8, as vLLM does when B does not fit."""

    launches = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.served: list[int] = []

    @contextlib.contextmanager
    def serve(self, batch_size: int) -> Iterator[str]:
        if batch_size >= 8:
            raise ProcessDied(f"vllm exited with code 1 before it was healthy (B={batch_size})")
        self.served.append(batch_size)
        yield self.url

    def describe(self, batch_size: int) -> str:
        return "launch"


def test_a_replica_that_dies_ends_the_sweep_and_keeps_the_points(fake_url: str, tmp_path: Path) -> None:
    """B=8 dying raises RunError naming B; B=2 and 4 are on disk; B=16 was never tried."""
    p = profiler(tmp_path, fake_url, batch_sizes=(2, 4, 8, 16), num_requests=4)
    servers = DyingServers(fake_url)
    p.servers = servers
    p.gpu = GpuSampler(FakeNvml(), interval_s=0.01)
    with pytest.raises(RunError, match="B=8: the replica failed: vllm exited"):
        p.run()
    assert servers.served == [2, 4]
    assert [pt.batch_size for pt in load_profile(tmp_path / "prof").points] == [2, 4]
    assert load_profile(tmp_path / "prof").points[0].gpu.memory_used_before_bytes == 10 * 2**30  # type: ignore[union-attr]


def test_launched_server_caps_each_point_at_b() -> None:
    """The launch spec for B carries --max-num-seqs B, the user's vLLM args and the CPU KV space."""
    server = LaunchedServer(model="/m", port=9000, log_dir=Path("/tmp"), vllm_args=("--dtype", "half"),
                            cpu_kvcache_space_gib=2)
    spec = server.spec(64)
    assert (spec.max_num_seqs, spec.extra_args, spec.cpu_kvcache_space_gib) == (64, ("--dtype", "half"), 2)
    assert server.describe(64).startswith("launch VLLM_CPU_KVCACHE_SPACE=2 ")


def test_open_sampler_is_none_when_nvml_cannot_start() -> None:
    """No NVIDIA driver: no sampler, so the profile has no GPU fields (nothing faked)."""
    from planner.gpu import open_sampler

    assert open_sampler(nvml=FakeNvml(fail_init=True)) is None
    fake = FakeNvml()
    assert open_sampler(index=3, nvml=fake) is None and fake.shutdowns == 1
    sampler = open_sampler(nvml=FakeNvml())
    assert sampler is not None and sampler.name == "Fake H100"


def test_rerun_with_another_workload_refuses_to_mix_points(fake_url: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Points measured with other lengths are not silently reused: the rerun asks for another --out."""
    out = tmp_path / "prof"
    assert run_cli("--url", fake_url, "--out", str(out), "--batch-sizes", "1", "--num-requests", "4") == 0
    code = main(["profile", "--url", fake_url, "--out", str(out), "--batch-sizes", "1,2", "--input-tokens", "9",
                 "--output-tokens", "4"])
    assert code == 2
    assert "was measured with another model, device or workload" in capsys.readouterr().err
    assert not point_path(out, 2).exists()
