"""One closed-loop load from several client processes (planner/multiclient.py), against a FAKE replica (a process,
or in this one)."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from deploy.process import ManagedProcess
from planner.client import RequestResult, Timeouts
from planner.multiclient import Share, _drive, on_wall_clock, run_load_processes, split
from deploy.ports import free_ports
from planner.workload import RequestSpec
from tests.fake_replica import STATS, FakeBehavior, make_app


def specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(prompt=f"prompt {i}", max_tokens=5) for i in range(n)]


def test_split_deals_requests_in_turn_and_divides_the_concurrency() -> None:
    """10 requests at 5 in flight over 2 processes: 5 requests each, 3 + 2 in flight; never more processes
    than requests in flight."""
    shares = split(specs(10), 5, 2)
    assert [len(s.requests) for s in shares] == [5, 5] and [s.concurrency for s in shares] == [3, 2]
    assert [r.prompt for r in shares[1].requests] == [f"prompt {i}" for i in (1, 3, 5, 7, 9)]
    assert len(split(specs(10), 2, 4)) == 2 and len(split(specs(1), 8, 4)) == 1
    with pytest.raises(ValueError, match="must be >= 1"):
        split(specs(3), 0, 2)


def test_results_move_onto_the_wall_clock() -> None:
    """Each process's perf_counter times are moved by its own offset; latencies are unchanged."""
    moved = on_wall_clock([RequestResult(start=1.0, end=3.5, ttft_s=0.5)], 1000.0)
    assert (moved[0].start, moved[0].end, moved[0].ttft_s, moved[0].e2e_s) == (1001.0, 1003.5, 0.5, 2.5)


def test_processes_share_one_load_at_the_concurrency_asked(tmp_path: Path) -> None:
    """24 requests at 4 in flight from 2 processes: every one answered once, the replica saw exactly 4 at a
    time, and the results lie on one time axis (the wall clock of this run)."""
    port = free_ports()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tests.fake_replica", "--port", str(port), "--itl", "0.02"]
    with ManagedProcess("fake", argv, tmp_path / "fake.log", f"{url}/health", startup_timeout_s=30):
        before = time.time()
        load = run_load_processes(url, "fake-model", specs(24), 4, Timeouts(request_s=30.0), processes=2)
        after = time.time()
        with urllib.request.urlopen(f"{url}/fake/stats", timeout=5) as response:
            stats = json.load(response)
    assert len(load.results) == 24 and all(r.ok for r in load.results) and load.concurrency == 4
    assert load.client_cpu_s is not None and 0 < load.client_cpu_s < 2 * (after - before)  # two processes at most
    assert sorted(b["prompt"] for b in stats["bodies"]) == sorted(s.prompt for s in specs(24))
    assert stats["max_running"] == 4
    assert before <= min(r.start for r in load.results) and max(r.end for r in load.results) <= after
    # 6 waves of 5 tokens at 20 ms: the two processes ran side by side, not one after the other
    assert load.duration_s < 0.75 * sum(r.e2e_s for r in load.results) / 2


async def test_a_client_process_keeps_more_than_100_requests_in_flight(aiohttp_server: Any) -> None:
    """One client process's share at 120 in flight: the fake sees all 120 at once (aiohttp's default session
    would stop at 100 connections; planner.client.load_session)."""
    server = await aiohttp_server(make_app(FakeBehavior(ttft_s=0.6, itl_s=0.005)))
    url = str(server.make_url("")).rstrip("/")
    load = await _drive(url, "fake-model", Share(tuple(specs(120)), 120), Timeouts(request_s=30.0))
    assert server.app[STATS].max_running == 120 and all(r.error is None for r in load.results)
