"""bench/fairness_vllm.py's schedules, summary and report (the measuring itself: tests/test_priority_vllm.py and by
hand against a real replica)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.fairness_vllm import OUTPUT_TOKENS, PROMPT_WORDS, arrivals, attach_parts, body, main, report, summary
from bench.otlp_collector import Span


def test_arrivals_are_poisson_at_the_rate_within_the_run_and_seeded() -> None:
    a = arrivals("light0", "interactive", 20.0, 50.0, np.random.default_rng(3))
    assert a == arrivals("light0", "interactive", 20.0, 50.0, np.random.default_rng(3))
    assert 900 <= len(a) <= 1100 and all(0 <= x.at < 50 for x in a)
    assert [x.at for x in a] == sorted(x.at for x in a)
    assert {x.tenant for x in a} == {"light0"} and {x.band for x in a} == {"interactive"}
    assert all(PROMPT_WORDS[0] <= x.words <= PROMPT_WORDS[1] and OUTPUT_TOKENS[0] <= x.tokens <= OUTPUT_TOKENS[1]
               for x in a)
    request = body(a[0])
    assert len(request["prompt"].split()) == a[0].words and request["max_tokens"] == a[0].tokens
    assert request["stream"] is True


def _case(alone_ms: float, flood_ms: float) -> dict[str, object]:
    alone, flood = [alone_ms / 1e3] * 100, [flood_ms / 1e3] * 100
    return {"alone_p99": alone_ms / 1e3, "flood_p99": flood_ms / 1e3, "ratio": flood_ms / alone_ms,
            "alone_ttft": alone, "flood_ttft": flood, "flood_started": 10, "flood_sent": 100}


def test_summary_gives_the_median_of_seeds_and_the_pooled_ratio() -> None:
    seeds = {0: {"tenants": _case(20, 22), "priority": _case(20, 40)},
             1: {"tenants": _case(20, 30), "priority": _case(20, 20)},
             2: {"tenants": _case(40, 40), "priority": _case(20, 22)}}
    s = summary(seeds)
    assert s["tenants"]["seed_ratios"] == pytest.approx([1.1, 1.5, 1.0])
    assert s["tenants"]["median_ratio"] == pytest.approx(1.1)
    assert s["priority"]["median_ratio"] == pytest.approx(1.1)
    # pooled: every sample of the three seeds, then p99 (the slowest seed's level decides it)
    assert s["tenants"]["pooled_ratio"] == pytest.approx(1.0)
    assert s["priority"]["pooled_ratio"] == pytest.approx(2.0)
    text = report({"command": "python -m bench.fairness_vllm", "capacity": 50.0, "seeds": seeds, "seconds": 20,
                   "cap": 8, "headroom": 6, "wall_s": 100, "summary": s})
    assert "| tenants | 40.0 ms | 40.0 ms | 1.00 | 1.10, 1.50, 1.00 | **1.10** |" in text


def _spans(trace: str, client_s: float, queue_s: float) -> list[Span]:
    """A traced request's gateway and vLLM spans: 2 ms of the gateway's path, 10 ms in vLLM's engine."""
    gateway = Span("gw", "gateway.request", trace, "r", "", 2, {"gen_ai.latency.time_to_first_token":
                                                                 client_s - 0.001}, (), False)
    queue = Span("gw", "gateway.queue", trace, "q", "r", 1, {}, (), False, 0, int(queue_s * 1e9))
    engine = Span("vllm", "llm_request", trace, "v", "u", 2, {"gen_ai.latency.time_in_queue": 0.0,
                                                               "gen_ai.latency.time_to_first_token": 0.010}, (), False)
    return [gateway, engine] + ([queue] if queue_s else [])


def test_a_traced_run_says_where_the_slow_requests_time_went() -> None:
    """The slow requests with the flood (over the pooled p99 alone) waited in the gateway's queue here."""
    seeds = {}
    collected: list[Span] = []
    for seed in range(2):
        record: dict[str, dict[str, object]] = {}
        for case in ("tenants", "priority"):
            alone, flood = [0.013] * 50, [0.013] * 48 + [0.080, 0.090]
            traces = [f"{seed}{case}{phase}{i}" for phase in ("a", "f") for i in range(50)]
            for trace, ttft in zip(traces, alone + flood):
                collected.extend(_spans(trace, ttft, max(0.0, ttft - 0.013)))
            record[case] = {"alone_p99": 0.013, "flood_p99": 0.09, "ratio": 6.9, "alone_ttft": alone,
                            "flood_ttft": flood, "alone_trace": traces[:50], "flood_trace": traces[50:],
                            "flood_late": [0.001] * 50, "flood_started": 10, "flood_sent": 100}
        seeds[seed] = record
    attach_parts(seeds, lambda: collected, timeout_s=1.0)
    s = summary(seeds)
    parts = s["tenants"]["parts"]
    assert parts["alone"][0] == 100 and parts["with the flood, within"][0] == 96
    n, slower = parts["with the flood, slower"]
    assert n == 4 and slower["gateway_queue"] == pytest.approx(0.072) and slower["engine_work"] == pytest.approx(0.010)
    assert slower["client"] == pytest.approx(0.001) and slower["path"] == pytest.approx(0.002)
    text = report({"command": "c", "capacity": 50.0, "seeds": seeds, "seconds": 20, "cap": 8, "headroom": 6,
                   "wall_s": 100, "summary": s})
    assert "Where the tenants case's protected requests' time to first token went" in text
    assert "| with the flood, slower | 4 | 85.0 | 1.0 | 72.0 | 2.0 | 0.0 | 10.0 |" in text
    assert "at most 1.0 ms late (tenants)" in text


@pytest.mark.parametrize("argv", [["--cap", "4", "--headroom", "4"], ["--seeds", "0"], ["--replica-cpus", "99"],
                                  ["--trace", "--replica", "http://127.0.0.1:1"]])
def test_bad_arguments_are_refused_before_anything_starts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
