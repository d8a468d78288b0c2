"""The report on synthetic records: summary figures, burst recovery, timelines, the table and the plots."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from loadtest.plots import latency_cdfs, write_run_plots
from loadtest.records import RequestRecord, read_records, write_records
from loadtest.report import RunInfo, burst_recovery, max_in_flight, recovery_time, summarize, timeline
from loadtest.table import format_table


def _ok(index: int, sent: float, ttft: float, gaps: tuple[float, ...], scheduled: float | None = None,
        replica: str | None = "http://r1") -> RequestRecord:
    return RequestRecord(index=index, target="http://gw", scheduled_s=sent if scheduled is None else scheduled,
                         sent_s=sent, end_s=sent + ttft + sum(gaps), ok=True, status=200, replica=replica,
                         ttft_s=ttft, itl_s=gaps, output_tokens=len(gaps) + 1, prompt_tokens=10,
                         requested_prompt_tokens=12, max_tokens=len(gaps) + 1)


def _failed(index: int, sent: float, end: float, error: str) -> RequestRecord:
    return RequestRecord(index=index, target="http://gw", scheduled_s=sent, sent_s=sent, end_s=end, ok=False,
                         status=503, error=error, requested_prompt_tokens=12, max_tokens=4)


RECORDS = [
    _ok(0, 0.0, 0.2, (0.1, 0.1, 0.1)),  # e2e 0.5, tpot 0.1
    _ok(1, 1.002, 0.4, (0.2, 0.2, 0.2), scheduled=1.0, replica="http://r2"),  # e2e 1.0, lag 2 ms
    _ok(2, 2.01, 0.6, (0.3,), scheduled=2.0),  # e2e 0.9, lag 10 ms
    _failed(3, 3.0, 3.5, "HTTP 503: overloaded"),
]
INFO = RunInfo(mode="open", duration_s=4.0, scheduled=5)


def test_summary_follows_vllm_bench_keys_and_values() -> None:
    """Counts, throughputs and latency statistics come out exactly, in vllm bench's key names."""
    s = summarize(RECORDS, INFO)
    assert (s["completed"], s["failed"], s["not_sent"]) == (3, 1, 1)
    assert s["duration"] == pytest.approx(3.5)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 4 + 4 + 2
    assert s["request_throughput"] == pytest.approx(3 / 3.5)
    assert s["output_throughput"] == pytest.approx(10 / 3.5)
    assert s["total_token_throughput"] == pytest.approx(40 / 3.5)
    assert s["mean_ttft_ms"] == pytest.approx(400.0) and s["median_ttft_ms"] == pytest.approx(400.0)
    assert s["p99_ttft_ms"] == pytest.approx(float(np.percentile([200, 400, 600], 99)))
    assert s["mean_tpot_ms"] == pytest.approx((100 + 200 + 300) / 3)
    assert s["mean_itl_ms"] == pytest.approx((3 * 100 + 3 * 200 + 300) / 7)
    assert s["mean_e2el_ms"] == pytest.approx((500 + 1000 + 900) / 3)
    assert s["std_e2el_ms"] == pytest.approx(float(np.std([500, 1000, 900])))


def test_summary_reports_offered_and_achieved_rate_lag_and_replicas() -> None:
    """Open-loop facts: offered vs achieved rate, schedule lag, in flight, replicas and failure reasons."""
    s = summarize(RECORDS, INFO)
    assert s["offered_rate"] == pytest.approx(5 / 4.0)
    assert s["achieved_rate"] == pytest.approx(4 / 4.0)
    assert s["schedule_lag_mean_ms"] == pytest.approx((0 + 2 + 10 + 0) / 4)
    assert s["schedule_lag_max_ms"] == pytest.approx(10.0)
    assert s["max_in_flight"] == 1
    assert s["requests_per_replica"] == {"http://gw": 1, "http://r1": 2, "http://r2": 1}
    assert s["failure_reasons"] == {"HTTP 503: overloaded": 1}


def test_closed_loop_and_empty_runs_leave_open_loop_figures_blank() -> None:
    """Without a schedule there is no offered rate or lag; with no records the statistics are None."""
    closed = [RequestRecord(index=0, target="http://a", scheduled_s=None, sent_s=0.0, end_s=1.0, ok=True,
                            ttft_s=0.5, output_tokens=1)]
    s = summarize(closed, RunInfo(mode="closed", duration_s=10.0))
    assert s["offered_rate"] is None and s["schedule_lag_mean_ms"] is None
    assert s["mean_ttft_ms"] == pytest.approx(500.0) and s["mean_tpot_ms"] is None  # one token: no TPOT
    empty = summarize([], INFO)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["request_throughput"] == 0.0


def test_max_in_flight_counts_overlaps_and_not_back_to_back_requests() -> None:
    """Overlapping requests add up; one ending as the next starts does not."""
    overlap = [_ok(i, 0.1 * i, 0.5, ()) for i in range(4)]
    back_to_back = [_ok(0, 0.0, 1.0, ()), _ok(1, 1.0, 1.0, ())]
    assert (max_in_flight(overlap), max_in_flight(back_to_back)) == (4, 1)


def _burst_run(recovers_after: float, second_recovers: bool) -> list[RequestRecord]:
    """Base requests every 0.1 s with TTFT 100 ms; after each burst TTFT is raised, falling to
    normal `recovers_after` seconds later (the second burst never recovers unless asked)."""
    records, index = [], 0
    for burst_at in (10.0, 20.0):
        records += [_ok(index + i, burst_at + 0.001 * i, 1.0, (0.01,), scheduled=burst_at) for i in range(20)]
        index += 20
    for k in range(300):
        t = round(0.1 * k + 0.05, 6)
        since = min((t - b for b in (10.0, 20.0) if t >= b), default=None)
        extra = 0.0
        if since is not None:
            still = since < recovers_after or (t >= 20.0 and not second_recovers)
            extra = 0.5 if still else 0.0
        records.append(_ok(index, t, 0.1 + extra, (0.01,)))
        index += 1
    return records


def test_burst_recovery_finds_when_p99_returns_to_the_pre_burst_level() -> None:
    """Recovery is the time after the burst when windowed p99 TTFT is back at its pre-burst p99."""
    result = burst_recovery(_burst_run(recovers_after=2.0, second_recovers=True), [10.0, 20.0], 10.0)
    assert [r["at_s"] for r in result] == [10.0, 20.0]
    assert [r["requests"] for r in result] == [20, 20]
    for r in result:
        assert r["ttft"]["baseline_p99_ms"] == pytest.approx(100.0, abs=1e-6)
        assert r["ttft"]["recovery_s"] == pytest.approx(2.0, abs=0.25)
        assert r["drain_s"] == pytest.approx(0.019 + 1.01, abs=1e-6)


def test_burst_that_never_recovers_before_the_next_reports_none() -> None:
    """If latency stays high until the end of the period, recovery is None (not recovered)."""
    result = burst_recovery(_burst_run(recovers_after=1.0, second_recovers=False), [10.0, 20.0], 10.0)
    assert result[0]["ttft"]["recovery_s"] == pytest.approx(1.0, abs=0.25)
    assert result[1]["ttft"]["recovery_s"] is None
    s = summarize(_burst_run(1.0, False), RunInfo("open", 30.0, scheduled=340, bursts_s=(10.0, 20.0),
                                                  burst_period_s=10.0))
    assert "Burst recovery, p99 TTFT" in format_table([s]) and "(1/2 not)" in format_table([s])


def test_recovery_time_needs_a_window_within_tolerance() -> None:
    """recovery_time returns the first window start whose p99 is within 10% of the baseline."""
    times = np.arange(0.0, 10.0, 0.1)
    latencies = np.where(times < 3.0, 2.0, 1.05)
    assert recovery_time(times, latencies, baseline=1.0, span=10.0, window=1.0) == pytest.approx(3.0, abs=0.2)
    assert recovery_time(times, latencies, baseline=0.5, span=10.0, window=1.0) is None


def test_timeline_bins_sends_completions_tokens_and_in_flight() -> None:
    """Per-second bins count sends, completions and token arrivals; the in-flight step rises and falls."""
    records = [_ok(0, 0.2, 0.3, (0.2, 0.2)), _ok(1, 0.5, 0.3, (0.2,)), _ok(2, 1.5, 0.1, ())]
    tl = timeline(records, schedule=[0.2, 0.5, 1.5, 2.5])
    assert tl.edges.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert tl.scheduled.tolist() == [2, 1, 1] and tl.sent.tolist() == [2, 1, 0]
    assert tl.completed.tolist() == [1, 2, 0]  # ends at 1.0, 0.9 ... first bin holds 0.9, 1.0 falls in the second
    assert tl.output_tokens.sum() == 3 + 2 + 1
    assert max(tl.in_flight_n) == 2 and tl.in_flight_n[-1] == 0


def test_records_round_trip_through_jsonl_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    """Records written as JSONL read back equal (to the microsecond); a half-written last line is dropped."""
    path = tmp_path / "records.jsonl"
    with path.open("w") as f:
        write_records(f, RECORDS)
        f.write('{"index": 9, "targ')
    assert read_records(path) == [replace(r, end_s=round(r.end_s, 6)) for r in RECORDS]


def test_table_shows_each_run_side_by_side() -> None:
    """The compare table has a column per target and a row per replica and failure reason."""
    text = format_table([summarize(RECORDS, INFO), summarize(RECORDS[:2], INFO)], ["gw", "rr"])
    lines = text.splitlines()
    assert lines[1].split() == ["gw", "rr"]
    assert next(line for line in lines if line.startswith("Completed requests")).split()[-2:] == ["3", "2"]
    assert next(line for line in lines if line.startswith("Requests to http://r2")).split()[-2:] == ["1", "1"]
    assert next(line for line in lines if line.startswith("Failed: HTTP 503")).split()[-2:] == ["1", "0"]


def test_plots_are_written_as_png(tmp_path: Path) -> None:
    """The run's three PNGs and an overlaid comparison are written and are PNG files."""
    records = _burst_run(2.0, True)
    paths = write_run_plots(records, tmp_path, schedule=[r.scheduled_s or 0.0 for r in records], bursts=[10.0, 20.0])
    paths.append(latency_cdfs({"a": records, "b": RECORDS}, tmp_path / "compare.png"))
    assert [p.name for p in paths] == ["latency_cdf.png", "over_time.png", "replicas.png", "compare.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
