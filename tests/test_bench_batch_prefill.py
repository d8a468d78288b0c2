"""`bench.batch_prefill`: the split of a request's prompts into steps from vLLM's step buckets, the fit's recovery of
known costs, and the probe end to end against a SIMULATED replica (`sim serve --config` of the tiny model's
calibration). The real replica's readings are in docs/sim.md's notebook."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from bench.batch_prefill import Probe, Scrape, compositions, features, fit, main, split_of
from bench.sim_vs_real import serve_sim
from deploy.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "docs" / "bench" / "sim_vs_real_replica_slowsteps_2026-11-29.json"
EDGES = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, float("inf"))


def scrapes(steps: list[int]) -> tuple[Scrape, Scrape]:
    """Counters before and after steps of these token counts, as vLLM's cumulative buckets have them."""
    before = Scrape(0.0, 0.0, 10.0, {e: 10.0 for e in EDGES})
    after = {e: 10.0 + sum(1 for t in steps if t <= e) for e in EDGES}
    return before, Scrape(1.0, 1.0, 10.0 + len(steps), after)


def test_compositions_are_every_ordered_cut() -> None:
    assert list(compositions(4, 2)) == [(1, 3), (2, 2), (3, 1)]
    assert list(compositions(3, 3)) == [(1, 1, 1)]
    assert len(list(compositions(8, 3))) == 21  # C(7, 2)


def test_the_split_is_read_from_the_buckets_where_they_decide_it() -> None:
    assert split_of(8, 128, *scrapes([129, 7 * 129])) == (1, 7)  # 129 -> (128, 256], 903 -> (512, 1024]
    assert split_of(2, 128, *scrapes([129, 129])) == (1, 1)
    assert split_of(4, 64, *scrapes([4 * 65])) == (4,)
    # 2 + 6 and 3 + 5 prompts of 128 put their steps in the same two buckets: left open
    assert split_of(8, 128, *scrapes([2 * 129, 6 * 129])) is None
    # no buckets but +Inf (sim serve): two steps of four prompts could be any cut
    before, after = Scrape(0, 0, 0, {float("inf"): 0.0}), Scrape(1, 4, 2, {float("inf"): 2.0})
    assert split_of(4, 64, before, after) is None
    assert split_of(2, 64, before, after) == (1, 1)


def test_the_fit_recovers_known_costs() -> None:
    """Probes made from a step of 4 ms + 0.5 ms a prompt + 25 us a token + 20 ns a pair, split as vLLM splits."""
    coef = np.array([4.0, 0.5, 25e-3, 20e-6])
    probes = [Probe(k, n, float(features(n, split) @ coef), split)
              for k, n, split in ((1, 64, (1,)), (1, 512, (1,)), (1, 1024, (1,)), (2, 128, (1, 1)),
                                  (4, 128, (1, 3)), (8, 64, (1, 7)), (16, 64, (16,)), (32, 32, (1, 31)))]
    probes.append(Probe(8, 128, 999.0, None))  # a split left open: not used
    result = fit(probes)
    assert result.probes == 8
    assert (result.base_ms, result.per_prompt_ms, result.per_token_us, result.per_pair_ns) == pytest.approx(
        (4.0, 0.5, 25.0, 20.0), rel=1e-6)
    with pytest.raises(ValueError, match="at least 4"):
        fit(probes[:3])


def test_the_probe_runs_against_a_simulated_replica(tmp_path: Path, tiny_tokenizer: str) -> None:
    """One round of every shape: each probe's prompts all prefilled, its mean prefill positive, and a fit."""
    out = tmp_path / "batch.json"
    with ExitStack() as stack:
        urls, _ = serve_sim(stack, str(MODEL), 1, free_ports(1), tmp_path / "sim.log", tiny_tokenizer)
        assert main(["--replica", urls[0], "--reps", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert len(record["probes"]) == 21 and all(p["prefill_ms"] > 0 for p in record["probes"])
    assert record["fit"]["probes"] >= 4
    one = {p["n"]: p["prefill_ms"] for p in record["probes"] if p["k"] == 1}
    assert one[1024] > 3 * one[128]


def test_a_replica_that_does_not_answer_is_an_error_not_a_crash(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_ports(1)
    assert main(["--replica", f"http://127.0.0.1:{port}", "--reps", "1"]) == 1
    assert "bench.batch_prefill" in capsys.readouterr().err
