"""bench.gateway_peers' report: ratios to the vLLM router, from the rounds' own pairs where the paced column was paired."""

from __future__ import annotations

from bench.gateway_peers import P50, REFERENCE, SCENARIOS, report

REQUEST, B2B, PACED = SCENARIOS


def result(paired: dict[str, dict[str, list[float]]]) -> dict[str, object]:
    figures = {
        REQUEST: {REFERENCE: [300.0, 320.0, 310.0], "this gateway": [80.0, 90.0, 85.0]},
        B2B: {REFERENCE: [5.0, 5.0, 5.0], "this gateway": [1.5, 1.5, 1.5]},
        PACED: {REFERENCE: [20.0, 30.0, 25.0], "this gateway": [19.0, 27.0, 24.0]},
        P50: {"direct": [1000.0], REFERENCE: [3000.0], "this gateway": [1500.0]},
    }
    return {"figures": figures, "paired": paired, "rounds": 3, "load_cores": [0], "gateway_core": [1],
            "command": "python -m bench.gateway_peers"}


def test_unpaired_ratios_are_of_the_medians() -> None:
    table = report(result({}))
    row = next(line for line in table.splitlines() if line.startswith("| this gateway"))
    assert "85.0 (0.27x)" in row and "1.5 (0.30x)" in row and "24.0 (0.96x)" in row and "1500.0 (0.50x)" in row
    assert "paired" not in table


def test_paired_ratio_is_the_median_of_the_rounds_ratios_with_their_range() -> None:
    # the medians of the figures would give 24 / 25 = 0.96x; the rounds' own ratios say 0.90-0.95, median 0.93
    table = report(result({PACED: {"this gateway": [0.95, 0.90, 0.93]}}))
    row = next(line for line in table.splitlines() if line.startswith("| this gateway"))
    assert "24.0 (0.93x, 0.90-0.95)" in row and "85.0 (0.27x)" in row
    assert "Paced column paired" in table
