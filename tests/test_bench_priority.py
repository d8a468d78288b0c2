"""bench/priority_vllm.py's pooling and report (the measuring itself runs against a real replica, by hand)."""

from __future__ import annotations

import pytest

from bench.priority_vllm import PHASES, report, summarize


def _round(alone_ms: float, flood_ms: float, n: int = 100) -> dict[str, list[float]]:
    """A round whose phases alone take `alone_ms` and under a flood `flood_ms`, but for two samples 10 x slower."""
    def samples(ms: float) -> list[float]:
        return [ms / 1e3] * (n - 2) + [10 * ms / 1e3] * 2
    return {"alone": samples(alone_ms), "priority": samples(flood_ms), "tenants": samples(flood_ms),
            "direct alone": samples(alone_ms / 2), "direct": samples(flood_ms / 2)}


def test_phases_are_pooled_over_rounds_and_each_compared_with_its_own_alone() -> None:
    rounds = [_round(10, 12), _round(10, 12), _round(20, 24)]
    summary = summarize(rounds)
    assert set(summary["pooled"]) == set(PHASES)
    assert summary["pooled"]["alone"]["n"] == 300
    # Pooled, the six slow samples (four of 100 ms, two of 200) are the 2% tail of 300: p99 is one of them.
    assert 0.1 <= summary["pooled"]["alone"]["p99"] <= 0.2
    # Each phase under a flood is 1.2 x its phase alone in every round and pooled; direct against direct alone,
    # not against the gateway's alone (which is twice as slow here).
    for name in ("priority", "tenants", "direct"):
        assert summary["p99_x_alone"][name] == pytest.approx(1.2)
        assert summary["p90_x_alone"][name] == pytest.approx(1.2)
        assert [r[name] for r in summary["rounds_p99_x_alone"]] == pytest.approx([1.2, 1.2, 1.2])


def test_report_shows_every_phase_and_the_ratios() -> None:
    result = {"command": "python -m bench.priority_vllm --rounds 2", "rounds": 2, "samples": 100, "seconds": 60.0,
              "summary": summarize([_round(10, 15), _round(10, 15)])}
    text = report(result)
    for name in PHASES:
        assert f"| {name} | 200 |" in text
    assert "| 1.50 |" in text and "priority 1.50, tenants 1.50, direct 1.50" in text


@pytest.mark.parametrize("cpus", ["99", "all"])
def test_replica_cpus_must_leave_this_process_a_core(cpus: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--replica-cpus names cores this process may use, and not every one of them (the gateway and clients keep the
    rest); checked before any replica starts."""
    from bench.priority_vllm import main
    from deploy.hardware import usable_cpus

    value = ",".join(map(str, usable_cpus())) if cpus == "all" else cpus
    with pytest.raises(SystemExit) as exc:
        main(["--replica-cpus", value])
    assert exc.value.code == 2 and "--replica-cpus must be some, not all" in capsys.readouterr().err
