"""bench/fairness_vllm.py's schedules, summary and report (the measuring itself: tests/test_priority_vllm.py and by
hand against a real replica)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.fairness_vllm import OUTPUT_TOKENS, PROMPT_WORDS, arrivals, body, main, report, summary


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


@pytest.mark.parametrize("argv", [["--cap", "4", "--headroom", "4"], ["--seeds", "0"], ["--replica-cpus", "99"]])
def test_bad_arguments_are_refused_before_anything_starts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
