"""`bench.prefill_cost`'s fit on made-up readings (its measurement needs a real replica: docs/sim.md has the run)."""

from __future__ import annotations

import pytest

from bench.prefill_cost import CELLS, Reading, cells_within, fit, main


def test_the_fit_recovers_a_prefill_that_grows_with_the_context_attended() -> None:
    """Readings made from 4 ms + 150 us a token + 60 ns a (query, key) pair, each off by +-1%: the fit gives the
    three back within a few percent and every cell within 2%."""
    def ms(cached: int, new: int) -> float:
        return 4.0 + 0.150 * new + 60e-6 * new * (cached + new / 2)

    readings = [Reading(c, n, ms(c, n) * (1.01 if i % 2 else 0.99), 0.0, 5) for i, (c, n) in enumerate(CELLS)]
    result = fit(readings)
    assert result.base_s == pytest.approx(4e-3, rel=0.15)
    assert result.per_token_s == pytest.approx(150e-6, rel=0.05)
    assert result.per_pair_s == pytest.approx(60e-9, rel=0.05)
    assert len(result.errors) == len(CELLS) and max(abs(e) for e in result.errors) < 0.02
    assert result.predict_s(1024, 384) == pytest.approx(ms(1024, 384) / 1e3, rel=0.02)
    with pytest.raises(ValueError, match="at least 3 cells"):
        fit(readings[:2])


def test_cells_fit_the_replicas_context_and_an_unreachable_replica_is_a_clear_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cells_within(CELLS, None) == list(CELLS) and cells_within(CELLS, 2048) == list(CELLS)
    assert cells_within(CELLS, 1024) == [(0, 128), (0, 384), (256, 128), (256, 384), (512, 128), (512, 384)]
    assert main(["--replica", "http://127.0.0.1:9"]) == 1
    assert "bench.prefill_cost: http://127.0.0.1:9:" in capsys.readouterr().err
