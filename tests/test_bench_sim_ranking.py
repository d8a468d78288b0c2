"""bench.sim_ranking: the simulator's policy ratios, in virtual time, against the real side's pooled intervals."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bench.policy_verdict import Ratio
from bench.sim_ranking import Pair, closed_loop_capacity, main, read_real, schedule, tail
from sim.measured import ReplicaModel
from sim.node import MeasuredSpec

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "docs" / "bench" / "sim_vs_real_replica.json"
VERDICT = ROOT / "docs" / "bench" / "policy_verdict_8dirs_2026-11-27.md"


def test_the_schedules_are_the_load_generators_seeded_mix() -> None:
    arrivals, specs = schedule("mix", 10.0, 12.0, seed=3)
    again, same = schedule("mix", 10.0, 12.0, seed=3)
    other, _ = schedule("mix", 10.0, 12.0, seed=4)
    assert np.array_equal(arrivals, again) and specs == same
    assert not np.array_equal(arrivals[:10], other[:10])
    assert 80 < len(arrivals) < 160 and len(specs) == len(arrivals) and arrivals[-1] < 12.0
    assert {(s.prompt_tokens, s.output_tokens) for s in specs} == {(128, 32), (1024, 256)}
    assert 0.1 < sum(s.prompt_tokens == 1024 for s in specs) / len(specs) < 0.3


def test_bursts_are_the_gamma_gaps_bench_sim_vs_real_sends(capsys: pytest.CaptureFixture[str]) -> None:
    """`--arrivals gamma` is what `bench.sim_vs_real` sends at its bursty points: gaps with a coefficient of
    variation of 2 (burstiness 0.25), at the same mean rate and with the same lengths as Poisson's for a seed."""
    poisson, lengths = schedule("mix", 10.0, 600.0, seed=3)
    bursts, same_lengths = schedule("mix", 10.0, 600.0, seed=3, arrival="gamma")
    gaps = [np.diff(a) for a in (poisson, bursts)]
    cv = [float(np.std(g) / np.mean(g)) for g in gaps]
    assert cv[0] == pytest.approx(1.0, abs=0.1) and cv[1] == pytest.approx(2.0, abs=0.3)
    assert len(bursts) == pytest.approx(6000, rel=0.15)
    n = min(len(lengths), len(same_lengths))
    assert lengths[:n] == same_lengths[:n]
    with pytest.raises(SystemExit) as exc:
        main(["--replica-model", str(MODEL), "--real", str(VERDICT), "--arrivals", "poisson,bursty"])
    assert exc.value.code == 2 and "--arrivals: unknown bursty (known: poisson, gamma)" in capsys.readouterr().err


def test_capacity_in_virtual_time_matches_the_real_time_harness() -> None:
    """bench.sim_vs_real measured this model's capacity through `sim serve`, the real gateway and the load
    generator in real time (docs/bench/sim_vs_real_first_2026-11-25.md: mix 12.06,
    sharegpt 12.14 requests/s)."""
    spec = MeasuredSpec(ReplicaModel.load(str(MODEL)), 2)
    assert closed_loop_capacity(spec, "mix") == pytest.approx(12.06, rel=0.05)
    assert closed_loop_capacity(spec, "sharegpt") == pytest.approx(12.14, rel=0.05)


def test_the_real_intervals_are_read_from_a_policy_verdict_report(tmp_path: Path) -> None:
    real = read_real(VERDICT)
    assert len(real) == 6 and all(len(by) == 3 for by in real.values())
    assert real["mix/poisson/0.8"]["least_requests"] == Ratio(0.80, 0.71, 0.93, 14)
    assert real["sharegpt/poisson/0.95"]["round_robin"] == Ratio(0.94, 0.81, 1.11, 28)
    empty = tmp_path / "other.md"
    empty.write_text("| point | a | b |\n|---|---|---|\n| x | 1 | 2 |\n")
    with pytest.raises(ValueError, match="no interval table"):
        read_real(empty)


def test_a_pair_is_judged_against_the_real_interval() -> None:
    decided = Ratio(0.80, 0.71, 0.93, 14)
    open_ = Ratio(1.02, 0.89, 1.13, 15)
    assert Pair("p", "o", decided, Ratio(0.77, 0.67, 0.83, 30)).decided
    assert Pair("p", "o", decided, Ratio(0.77, 0.67, 0.83, 30)).alike
    assert Pair("p", "o", decided, Ratio(0.77, 0.67, 0.83, 30)).inside
    assert not Pair("p", "o", decided, Ratio(1.05, 0.9, 1.2, 30)).alike
    assert not Pair("p", "o", open_, Ratio(0.69, 0.65, 0.80, 30)).decided
    assert not Pair("p", "o", open_, Ratio(0.69, 0.65, 0.80, 30)).inside
    level = Pair("p", "o", open_, Ratio(1.0, 1.0, 1.0, 30))
    assert level.level and not level.alike and level.inside


def test_the_tail_says_whether_its_long_prompts_queued_behind_others() -> None:
    quick = [[0.1 * i, 0.02, 128, 0] for i in range(200)]
    collided = {"firsts": [*quick, [30.0, 0.10, 1024, 1], [30.01, 0.30, 1024, 1], [40.0, 0.11, 1024, 0]]}
    t = tail([collided])
    assert t.p99_ms == pytest.approx(np.percentile([f[1] for f in collided["firsts"]], 99) * 1e3)
    assert t.long_share == 1.0 and t.behind_long > 0
    stalled = {"firsts": [*quick, [50.0, 0.5, 128, 0], [30.0, 0.10, 1024, 1], [40.0, 0.11, 1024, 0]]}
    t = tail([stalled])
    assert t.long_share < 1.0
    assert math.isnan(tail([{"firsts": [*quick, [50.0, 0.5, 128, 0]]}]).behind_long)


def test_the_bench_reports_every_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ranking.md"
    main(["--replica-model", str(MODEL), "--real", str(VERDICT), "--seeds", "2", "--duration", "6",
          "--workloads", "mix", "--arrivals", "poisson,gamma", "--out", str(out)])
    text = out.read_text()
    assert text.strip() in capsys.readouterr().out
    assert "| mix/poisson/0.8 | least_requests | 0.80 (0.71-0.93; 14) |" in text
    assert "Pairs the real side decides (its interval excludes 1): 4;" in text  # the mix points' four
    assert "Where the slowest 1% of first tokens came from" in text
    assert "sharegpt" not in text.split("Simulated p99")[1]
    assert "| mix/gamma/0.95 |" in text.split("Simulated p99")[1]  # simulated, though this report has no bursts
