"""bench/frontend_core.py's figures and summary on made-up records (fast; the benchmark itself starts real vLLM)."""

from __future__ import annotations

import math

import pytest

from bench.frontend_core import main, phase_row, summary_lines


def records(short_ms: float, long_ms: float) -> list[dict[str, object]]:
    return ([{"ok": True, "ttft_s": short_ms / 1e3, "requested_prompt_tokens": 128}] * 4
            + [{"ok": True, "ttft_s": long_ms / 1e3, "requested_prompt_tokens": 1024}]
            + [{"ok": False, "ttft_s": None, "requested_prompt_tokens": 128}])


def test_a_phase_gives_its_ttft_the_short_prompts_and_vllms_split() -> None:
    """vLLM's TTFT less its queue and prefill is the API server's part; a failed request counts as failed."""
    row = phase_row("shared", 0, records(40.0, 120.0), {"engine_ttft_s": 0.05, "queue_s": 0.01, "prefill_s": 0.03})
    assert row["requests"] == 5 and row["failed"] == 1
    assert row["ttft_p50_ms"] == pytest.approx(40.0) and row["short_ttft_p50_ms"] == pytest.approx(40.0)
    assert row["api_server_ms"] == pytest.approx(10.0) and row["prefill_ms"] == pytest.approx(30.0)
    only_long = phase_row("apart", 0, records(40.0, 120.0)[4:5], {"engine_ttft_s": 0.1, "queue_s": 0.0,
                                                                   "prefill_s": 0.08})
    assert math.isnan(only_long["short_ttft_p50_ms"])
    with pytest.raises(ValueError, match="phase apart round 2: no request got a first token"):
        phase_row("apart", 2, records(1.0, 1.0)[5:], {})


def test_the_summary_sets_shared_over_apart_round_by_round() -> None:
    parts = {"engine_ttft_s": 0.05, "queue_s": 0.0, "prefill_s": 0.03}
    rows = [phase_row("shared", 0, records(60.0, 150.0), parts), phase_row("apart", 0, records(40.0, 100.0), parts),
            phase_row("shared", 1, records(90.0, 150.0), parts), phase_row("apart", 1, records(45.0, 100.0), parts),
            phase_row("shared", 2, records(50.0, 150.0), parts)]  # round 2 unfinished: left out
    text = "\n".join(summary_lines(rows))
    assert text.startswith("2 rounds") and "ttft_p50_ms: shared 75.0, apart 42.5; shared / apart 1.50, 2.00" in text
    assert summary_lines(rows[:1]) == ["no round has both phases"]


@pytest.mark.parametrize("argv", [["--engine-core", "0", "--other-core", "0"], ["--other-core", "999"],
                                  ["--rounds", "0"], ["--rate", "-1"]])
def test_bad_arguments_are_refused_before_anything_starts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "must be" in capsys.readouterr().err
