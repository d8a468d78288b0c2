"""`bench.sim_vs_real`'s schedule and report on made-up rows (fast; the real run is in tests/test_deploy_vllm.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bench.sim_vs_real import Setup
from bench.sim_vs_real_report import REPEAT, Run, done_runs, plot, repeatability, report, summarize
from bench.sim_vs_real_inflight import inflight_lines
from bench.sim_vs_real_ranking import ranking_lines, verdict_lines
from bench.sim_vs_real_steps import busy_s, decoding_context, per_run, speedometer_lines, steps_lines
from sim.measured import ReplicaModel

# The replica model most tests here evaluate: 5 ms a step at B = 1, 12.5 at B = 16, 50 us a prompt token.
MODEL = ReplicaModel(model_name="m", step_s=((1, 0.005), (16, 0.0125)), prefill_s_per_token=50e-6, frontend_s=0.0,
                     max_num_seqs=32, max_num_batched_tokens=2048, chunked_prefill=True, prefix_caching=True,
                     block_size=128, num_blocks=100, max_model_len=2048)


def setup(repeats: int) -> Setup:
    return Setup(replicas=2, seeds=2, duration=15.0, loads=(0.5, 0.8), workloads=("mix",), arrivals=("poisson",),
                 chat_rates=(), policies=("prefix_affinity", "round_robin"), chat_policies=(), port=18000,
                 out=Path("unused"), repeats=repeats)


def test_repeats_of_the_first_real_run_are_spread_over_the_real_series_only() -> None:
    """8 real runs, 3 repeats: after runs 3, 5 and 8 (the last closes the series); the simulated side has none."""
    runs = setup(3).runs("real")
    assert [i for i, r in enumerate(runs) if r.side == REPEAT] == [3, 6, 10] and len(runs) == 11
    first = runs[0]
    for k, r in enumerate((r for r in runs if r.side == REPEAT), start=1):
        assert (r.workload, r.arrival, r.load, r.seed, r.policy, r.repeat) == (first.workload, first.arrival,
                                                                               first.load, first.seed, first.policy, k)
        assert r.key == first.key.replace("real/", f"{REPEAT}/", 1) + f"#{k}"  # other prompts: the salt is the key's
    assert setup(3).runs("sim-together") == setup(0).runs("sim-together") and len(setup(0).runs("real")) == 8


def row(side: str, repeat: int, ttft_ms: float, tpot_ms: float, policy: str = "prefix_affinity") -> dict[str, object]:
    run = Run(side, "mix", "poisson", 0.5, 0, policy, repeat)
    return {**run.__dict__, "rate": 9.0, "completed": 4, "failed": 0, "hit_rate": 0.0, "same_replica": None,
            "ttft_s": [ttft_ms / 1e3] * 4, "tpot_s": [tpot_ms / 1e3] * 4, "e2e_s": [(ttft_ms + 10 * tpot_ms) / 1e3] * 4,
            "cpu": {"cores_busy": [0.9, 0.9], "replicas": [0.7, 0.7], "rest": 0.4}}


def test_repeatability_sets_each_repeat_beside_the_first_run_and_gives_the_spread(tmp_path: Path) -> None:
    """Run 0 at TPOT 5 ms, repeats at 6 and 8: +20% and +60%; one run lies 17% (median of 1/6, 0, 2/6) from
    the median, and the largest over the smallest is 1.60. Old rows (no "repeat" field) still load."""
    rows = [row("real", 0, 20.0, 5.0), row("real", 0, 30.0, 7.0, "round_robin"), row(REPEAT, 1, 20.0, 6.0),
            row("sim-together", 0, 21.0, 5.5), row(REPEAT, 2, 20.0, 8.0)]
    lines = "\n".join(repeatability(rows))
    assert "## How repeatable the real side is: mix/poisson/0.5/0/prefix_affinity, run 3 times" in lines
    assert "| 0 | 1 of 4 | 20 | 20 | 5.0 |" in lines and "| 1 | 3 of 4 | 20 | 20 | 6.0 |" in lines
    assert "| +0% | +0% | +20% |" in lines and "| +0% | +0% | +60% |" in lines
    assert "tpot_p50 17%" in lines and "tpot_p50 1.60" in lines and "ttft_p50 1.00" in lines
    assert repeatability([r for r in rows if r["side"] != REPEAT]) == []
    path = tmp_path / "runs.jsonl"
    old = {k: v for k, v in row("real", 0, 20.0, 5.0).items() if k != "repeat"}
    path.write_text("\n".join(json.dumps(r) for r in [old, *rows[2:]]) + "\n")
    assert list(done_runs(path)) == ["real/mix/poisson/0.5/0/prefix_affinity",
                                     f"{REPEAT}/mix/poisson/0.5/0/prefix_affinity#1",
                                     "sim-together/mix/poisson/0.5/0/prefix_affinity",
                                     f"{REPEAT}/mix/poisson/0.5/0/prefix_affinity#2"]
    text = report(tmp_path, {"capacity_real_mix": 18.0})
    assert "How repeatable" in text and "Real against `sim-together`" in text


def test_a_negative_repeat_count_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.sim_vs_real import main

    with pytest.raises(SystemExit) as exc:
        main(["--repeats", "-1", "--dry-run"])
    assert exc.value.code == 2 and "--repeats must be >= 0, got -1" in capsys.readouterr().err


def test_no_calibration_runs_the_real_side_alone_two_give_two_sides_and_an_unknown_one_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    from bench.sim_vs_real import main

    main(["--calibrations", "", "--seeds", "1", "--loads", "0.5", "--workloads", "mix", "--chat-rates", "",
          "--policies", "prefix_affinity,round_robin", "--repeats", "0", "--dry-run"])
    out = capsys.readouterr().out
    assert out.startswith("2 runs of 15 s") and "sim" not in out.split("\n", 1)[1]
    assert "real/mix/poisson/0.5/0/round_robin" in out
    main(["--calibrations", "isolated,together", "--seeds", "1", "--loads", "0.5", "--workloads", "mix",
          "--chat-rates", "", "--policies", "round_robin", "--repeats", "0", "--dry-run"])
    assert capsys.readouterr().out.split("\n")[1:4] == [  # each calibration a simulated side, after the real one
        "real/mix/poisson/0.5/0/round_robin", "sim/mix/poisson/0.5/0/round_robin",
        "sim-together/mix/poisson/0.5/0/round_robin"]
    with pytest.raises(SystemExit) as exc:
        main(["--calibrations", "together,alone", "--dry-run"])
    assert exc.value.code == 2 and "--calibrations: unknown alone" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # once taken for bursts: every arrival but poisson ran as gamma
        main(["--arrivals", "poisson,bursty", "--dry-run"])
    assert exc.value.code == 2 and "--arrivals: unknown bursty (known: poisson, gamma)" in capsys.readouterr().err


def test_more_seeds_start_where_told_and_core_work_needs_the_measured_prefill(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--first-seed 2 --seeds 2` runs seeds 2 and 3; `--core-work` takes the prefill per token as measured, so
    without the prefill cost (or beside the latency split) it is a usage error."""
    from bench.sim_vs_real import main

    main(["--seeds", "2", "--first-seed", "2", "--loads", "0.5", "--workloads", "mix", "--chat-rates", "",
          "--policies", "round_robin", "--repeats", "0", "--core-work", "--dry-run"])
    assert capsys.readouterr().out.split("\n")[1:4] == [
        "real/mix/poisson/0.5/2/round_robin", "real/mix/poisson/0.5/3/round_robin",
        "sim-together/mix/poisson/0.5/2/round_robin"]
    for flags in (["--no-prefill-cost"], ["--frontend-latency"], ["--quick"]):
        with pytest.raises(SystemExit) as exc:
            main(["--core-work", *flags, "--dry-run"])
        assert exc.value.code == 2 and "--core-work takes the prefill per token as measured" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--first-seed", "-1", "--dry-run"])
    assert exc.value.code == 2 and "--first-seed must be >= 0" in capsys.readouterr().err


def _run(side: str, policy: str, seed: int, ttft_ms: float) -> dict[str, object]:
    return {"side": side, "workload": "mix", "arrival": "poisson", "load": 0.8, "policy": policy, "seed": seed,
            "ttft_s": [ttft_ms / 1000] * 10, "tpot_s": [0.005] * 10, "e2e_s": [0.5] * 10, "hit_rate": float("nan"),
            "failed": 0}


def test_ranking_counts_the_pairs_every_real_seed_orders_alike_and_the_simulators_agreement() -> None:
    """Real: a < b and a < c in every seed, b against c flips. Simulated: a < b, but c < a. So 2 pairs are
    decided, and the simulator agrees on 1 of them; no two seeds rank all three alike."""
    real = {"a": [10, 11, 12], "b": [20, 21, 22], "c": [30, 15, 40]}
    rows = [_run("real", p, seed, ms[seed]) for p, ms in real.items() for seed in range(3)]
    rows += [_run("sim", p, seed, ms) for p, ms in {"a": 10, "b": 20, "c": 5}.items() for seed in range(3)]
    text = "\n".join(ranking_lines(rows, summarize(rows), "sim"))
    row = next(line for line in text.splitlines() if line.startswith("| mix/poisson/0.8"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:6] == ["3", "1 of 3", "0.78", "2 of 3", "1 of 2"]  # seeds 0 and 2 rank a, b, c alike
    assert "orders 1 of the 2 decided pairs" in text and "probability 0.25" in text


def test_ranking_needs_two_seeds_and_the_simulated_side() -> None:
    rows = [_run("real", p, 0, ms) for p, ms in {"a": 10, "b": 20}.items()]
    one_seed = rows + [_run("sim", "a", 0, 1), _run("sim", "b", 0, 2)]
    assert ranking_lines(one_seed, summarize(one_seed), "sim") == []  # one seed
    assert ranking_lines(rows, summarize(rows), "sim") == []  # no simulated side


def _cells(text: str, first: str) -> list[str]:
    row = next(line for line in text.splitlines() if line.startswith(f"| {first} "))
    return [c.strip() for c in row.strip("|").split("|")]


def test_the_verdict_names_no_policy_when_none_meets_the_goal_and_picks_the_smallest_worst_point() -> None:
    """d (the default) is 1.2 x the best at p1; b is 1.5 x at p2; round robin 1.3 x at p3. None is within 10% of
    the best everywhere, and d is worse than round robin at p1: the smallest worst point is d's."""
    p99 = {"p1": {"d": 120, "b": 100, "round_robin": 110}, "p2": {"d": 100, "b": 150, "round_robin": 100},
           "p3": {"d": 100, "b": 100, "round_robin": 130}}
    text = "\n".join(verdict_lines(p99, "d"))
    assert _cells(text, "d (default)") == ["d (default)", "1.20", "1.06", "1.09", "no"]
    assert _cells(text, "b") == ["b", "1.50", "1.14", "1.50", "no"]
    assert _cells(text, "round_robin") == ["round_robin", "1.30", "1.13", "", "no"]
    assert "Over 3 points: no policy meets it; the smallest worst point is d's (1.20 x the best)." in text


def test_the_verdict_names_the_policies_that_meet_the_goal() -> None:
    p99 = {"p1": {"d": 105, "b": 100, "round_robin": 105}, "p2": {"d": 100, "b": 120, "round_robin": 101}}
    text = "\n".join(verdict_lines(p99, "d"))
    assert _cells(text, "d (default)")[-1] == "yes" and _cells(text, "round_robin")[-1] == "yes"
    assert _cells(text, "b")[-1] == "no"  # 1.20 x the best at p2
    assert "Over 2 points: d, round_robin meet it." in text
    assert verdict_lines({"p1": {"d": 100}}, "d") == []  # one policy: nothing to judge


def _timed(side: str, load: float, rate: float, e2e: float, tpot_ms: float, rest: float, speed: float
           ) -> dict[str, object]:
    return {"side": side, "workload": "sharegpt", "arrival": "poisson", "load": load, "policy": "round_robin",
            "seed": 0, "rate": rate, "e2e_s": [e2e] * 4, "tpot_s": [tpot_ms / 1000] * 4, "ttft_s": [0.02] * 4,
            "cpu": {"rest": rest}, "speed_us": speed}


def test_tpot_is_set_beside_the_requests_in_flight_and_the_machine() -> None:
    """Little's law: 8 requests/s x 1 s / 2 replicas = 4 in flight each. Real TPOT rises with the rest's CPU and
    with the speedometer (rank correlation +1); the simulated run in the same bin is 20% faster."""
    rows = [_timed("real", 0.5, 8.0, 1.0, tpot, rest, speed)
            for tpot, rest, speed in ((5.0, 0.30, 11000), (6.0, 0.32, 12000), (7.0, 0.35, 13000))]
    rows.append(_timed("sim", 0.5, 8.0, 1.0, 4.8, 0.3, 11000))
    text = "\n".join(inflight_lines(rows, 2, "sim"))
    assert "| 3-5 | 3 | 6.0 | 1 | 4.8 | -20% |" in text
    assert "rank correlation of TPOT with rest +1.00" in text and "11000-13000 us +1.00 (3 runs)" in text
    assert "| 3 | sharegpt/0.5/0 | round_robin | 13.0 | 0.35 | 4.0 | 7.0 |" in text  # the series, in order
    assert inflight_lines([r for r in rows if r["side"] == "real"], 2, "sim") == []  # nothing to set it beside


def _stepped(side: str, steps: float, generated: float, prompt: float) -> dict[str, object]:
    return {"side": side, "workload": "sharegpt", "arrival": "poisson", "load": 0.8, "policy": "round_robin",
            "seed": 0, "engine": {"steps": steps, "tokens": generated + prompt, "generated": generated,
                                  "prompt": prompt, "span_s": 10.0}}


def test_the_engines_steps_are_set_side_by_side_and_against_the_replica_model(tmp_path: Path) -> None:
    """Two replicas over a 10 s span: 2,000 real steps are 10 ms each per replica, with 8 tokens sampled and 10 prompt
    tokens a step; 2,500 simulated steps are 8 ms. The replica model at the real batch: step(8) = 5 + 7.5 x 7/15 =
    8.5 ms, plus 10 prompt tokens at 50 us = 9.0 ms, 10% under the real step. Runs without the counters (before
    they were recorded) are left out."""
    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())
    rows = [_stepped("real", 2000, 16000, 20000), _stepped("real", 2000, 16000, 20000),
            _stepped("sim-together", 2500, 15000, 22500), {**_stepped("real", 1, 1, 1), "engine": None}]
    text = "\n".join(steps_lines(rows, 2, "sim-together", str(path)))
    assert "| sharegpt/poisson/0.8 | 2 | 8.0 | 6.0 | 10.00 | 8.00 | -20% | 10.0 | 9.0 | 9.00 | -10% |" in text
    assert "| sharegpt/poisson/0.8 | 2 | 8.0 | 6.0 | 10.00 | 8.00 | -20% | 10.0 | 9.0 |" in \
        "\n".join(steps_lines(rows, 2, "sim-together"))  # no model: the last two columns go
    assert steps_lines([r for r in rows if r["side"] == "real"], 2, "sim-together") == []
    # the side that follows the machine: the model at the real batch scaled as each real run's twin ran (1.2 x)
    followed = [*rows[:2], {**_stepped("sim-followed", 2000, 16000, 20000), "scale": 1.2}]
    assert "| 10.00 | 10.00 | +0% | 10.0 | 10.0 | 10.80 | +8% |" in \
        "\n".join(steps_lines(followed, 2, "sim-followed", str(path), scaled=True))


def test_a_step_is_timed_over_the_replicas_busy_time_not_the_idle_gaps_between_arrivals() -> None:
    """Replica a has requests in flight over [0, 2] (two overlapping) and [3, 4], replica b over [1, 1.5]: 3.5 s
    busy in a 10 s span. 350 steps are 10 ms each, where the span would make them 57 ms. Rows whose first tokens
    do not pair with their E2E times (a request without a first token) fall back to the span."""
    firsts = [[0.0, 0.1, 128, "a"], [0.5, 0.1, 128, "a"], [3.0, 0.1, 128, "a"], [1.0, 0.1, 128, "b"]]
    row = {**_stepped("real", 350, 700, 3500), "firsts": firsts, "e2e_s": [1.0, 1.5, 1.0, 0.5]}
    assert busy_s(row) == pytest.approx(3.5)
    assert per_run(row, 2) == pytest.approx((2.0, 10.0, 10.0))
    unpaired = {**row, "e2e_s": [1.0, 1.5, 1.0, 0.5, 2.0]}
    assert busy_s(unpaired) is None and per_run(unpaired, 2) == pytest.approx((2.0, 1000 * 20 / 350, 10.0))
    assert busy_s(_stepped("real", 350, 700, 3500)) is None  # rows from before `firsts`


def test_the_speedometer_is_held_against_the_engines_own_speed(tmp_path: Path) -> None:
    """Three real runs whose engines step 10, 11.1 and 13.3 ms where the model gives 9.0 ms (8 sampled, 10 prompt
    tokens a step): 1.11, 1.23 and 1.48 x, a median miss of 23%. A speedometer that read the same ratios over its
    calibration reading would take the miss to 0%; one that read them the other way round makes it 25%. Simulated
    runs, chat runs and runs without a reading do not count; without the model or the calibration's reading, or
    with fewer than three runs, there is no section."""
    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())
    steps = (2000, 1800, 1500)
    ratios = [20000 / n / 9.0 for n in steps]

    def runs(readings: list[float]) -> list[dict[str, object]]:
        return [{**_stepped("real", n, 8 * n, 10 * n), "speed_us": 20000 * r} for n, r in zip(steps, readings)]
    others = [{**_stepped("sim-together", 1000, 8000, 10000), "speed_us": 1.0},
              {**_stepped("real", 1000, 8000, 10000), "workload": "chat", "speed_us": 1.0},
              _stepped("real", 1000, 8000, 10000)]
    follows = "\n".join(speedometer_lines([*runs(ratios), *others], 2, str(path), 20000.0))
    assert "Over the 3 real single-turn runs: the engines stepped 1.11-1.48 x" in follows
    assert "Rank correlation +1.00" in follows and "23% as calibrated, 0% scaled by the speedometer (scaling helps)" \
        in follows
    against = "\n".join(speedometer_lines(runs(ratios[::-1]), 2, str(path), 20000.0))
    assert "Rank correlation -1.00" in against and "23% as calibrated, 25% scaled" in against
    assert "(scaling does not help)" in against
    assert speedometer_lines(runs(ratios), 2, None, 20000.0) == []
    assert speedometer_lines(runs(ratios), 2, str(path), None) == []
    assert speedometer_lines(runs(ratios)[:2], 2, str(path), 20000.0) == []


def test_the_replica_model_is_taken_at_each_real_runs_decoding_context(tmp_path: Path) -> None:
    """A run whose sequences decode at 720 tokens of context, halfway between the model's short (288) and long
    (1152) profiles: step(8) is halfway between 8.5 and 17 ms, 12.75 ms, plus 0.5 ms of prompt: 13.25 ms against
    the real 10 ms. The context is the mean over decode steps: sum(out x (prompt + out / 2)) / sum(out)."""
    model = ReplicaModel(model_name="m", step_s=((1, 0.005), (16, 0.0125)), prefill_s_per_token=50e-6,
                         frontend_s=0.0, max_num_seqs=32, max_num_batched_tokens=2048, chunked_prefill=True,
                         prefix_caching=True, block_size=128, num_blocks=100, max_model_len=2048,
                         step_context=288.0, long_step_s=((1, 0.010), (16, 0.025)), long_context=1152.0)
    path = tmp_path / "replica.json"
    path.write_text(model.to_json())
    rows = [{**_stepped("real", 2000, 16000, 20000), "context": 720.0}, _stepped("sim-together", 2500, 15000, 22500)]
    assert "| 13.25 | +33% |" in "\n".join(steps_lines(rows, 2, "sim-together", str(path)))
    assert "| 9.00 | -10% |" in "\n".join(steps_lines([{**rows[0], "context": None}, rows[1]], 2, "sim-together",
                                                           str(path)))  # no context recorded: the short profile's
    records = [{"output_tokens": 100, "prompt_tokens": 200},
               {"output_tokens": 300, "prompt_tokens": None, "requested_prompt_tokens": 1000}, {"output_tokens": 0}]
    assert decoding_context(records) == (100 * 250 + 300 * 1150) / 400
    assert decoding_context([{"output_tokens": 0}]) is None


def test_calibration_rounds_are_spread_over_the_real_series_and_their_spread_is_reported(tmp_path: Path) -> None:
    """3 rounds over 12 real runs: round 0 before all, round 1 before run 4, round 2 before run 8. The report
    section gives each round's TPOT at each point, the largest over the smallest and the round fitted (the median)."""
    from dataclasses import replace as replaced

    from planner.points import Latency, ProfileContext, ProfilePoint, Workload
    from planner.sources import write_point

    from bench.sim_vs_real_calibration import round_dir
    from bench.sim_vs_real_rounds import rounds_lines

    assert replaced(setup(0), calibration_rounds=3).round_marks(12) == {4: 1, 8: 2}
    assert setup(0).round_marks(12) == {}
    context = ProfileContext(model="m", device="cpu", workload=Workload("fixed", 256, 64))
    for k, tpots in enumerate(((5.0, 10.0), (6.0, 8.0), (4.0, 9.0))):
        for b, tpot in zip((1, 4), tpots):
            write_point(round_dir(tmp_path, "profile", "_together", k) / "0", context,
                        ProfilePoint(batch_size=b, total_tok_s=1.0, tpot_ms=Latency(mean=tpot)))
    dirs = [[round_dir(tmp_path, "profile", "_together", k) / "0" for k in range(3)]]
    assert dirs[0][1] == tmp_path / "profile_together-r1" / "0"
    text = "\n".join(rounds_lines(dirs, "`sim-together`"))
    assert "## Calibration rounds (`sim-together`)" in text
    assert "| 256 + 64 | 1 | 5.00 | 6.00 | 4.00 | 1.50 | 0 |" in text
    assert "| 256 + 64 | 4 | 10.00 | 8.00 | 9.00 | 1.25 | 2 |" in text
    assert rounds_lines(dirs + [[tmp_path / "missing"] * 3], "x") == [] and rounds_lines([dirs[0][:1]], "x") == []


def test_each_rounds_model_alone_is_set_beside_the_fitted_one_at_the_real_batch(tmp_path: Path) -> None:
    """Real steps of 10 ms at 8 sampled and 10 prompt tokens a step (as above): the model there is 9.0 ms (-10%);
    a round 1.2 x slower in every step gives 1.2 x 8.5 + 0.5 = 10.7 ms (+7%)."""
    from dataclasses import replace as replaced

    from bench.sim_vs_real_rounds import models_lines

    slow = replaced(MODEL, step_s=tuple((b, 1.2 * s) for b, s in MODEL.step_s))
    for name, m in (("fitted", MODEL), ("r0", MODEL), ("r1", slow)):
        (tmp_path / f"{name}.json").write_text(m.to_json())
    rows = [_stepped("real", 2000, 16000, 20000), _stepped("sim-together", 2500, 15000, 22500)]
    text = "\n".join(models_lines(rows, 2, str(tmp_path / "fitted.json"),
                                  [str(tmp_path / "r0.json"), str(tmp_path / "r1.json")]))
    assert "| point | runs | ms a step, real | fitted (median round) | round 0 alone | round 1 alone |" in text
    assert "| sharegpt/poisson/0.8 | 1 | 10.00 | -10% | -10% | +7% |" in text
    assert models_lines(rows[1:], 2, str(tmp_path / "fitted.json"), [str(tmp_path / "r0.json")]) == []


def test_fewer_than_one_calibration_round_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.sim_vs_real import main

    with pytest.raises(SystemExit) as exc:
        main(["--calibration-rounds", "0", "--dry-run"])
    assert exc.value.code == 2 and "--calibration-rounds must be >= 1, got 0" in capsys.readouterr().err


def test_the_matched_side_is_scaled_to_the_seed_0_runs_and_runs_only_the_others(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seed 0's real steps: 10 ms where the model gives 9.0 (x 1.11), and 9 ms (x 1.0): the scale is the median,
    1.056, for their workload; another workload gets its own. Later seeds, other sides and chat runs do not count;
    without a seed-0 run there is nothing to match."""
    from bench.sim_vs_real import MATCHED, main
    from bench.sim_vs_real_steps import matched_scale, warmup_scale

    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())
    slow, even = _stepped("real", 2000, 16000, 20000), _stepped("real", 2000 * 10 / 9, 16000 * 10 / 9, 20000 * 10 / 9)
    rows = [slow, even, {**_stepped("real", 1000, 16000, 20000), "seed": 1},
            {**_stepped("real", 1000, 16000, 20000), "workload": "chat"}, _stepped("sim-together", 1000, 8000, 100)]
    assert warmup_scale(rows, 2, str(path)) == {"sharegpt": pytest.approx((10 / 9 + 1) / 2)}
    scales = warmup_scale([*rows, {**slow, "workload": "mix"}], 2, str(path))  # each workload its own factor
    assert scales == {"mix": pytest.approx(10 / 9), "sharegpt": pytest.approx((10 / 9 + 1) / 2)}
    assert matched_scale(scales, "sharegpt") == scales["sharegpt"] and matched_scale(1.2, "sharegpt") == 1.2
    with pytest.raises(ValueError, match="no seed-0 real run of workload 'gamma'"):
        matched_scale(scales, "gamma")
    with pytest.raises(ValueError, match="no single-turn real run of seed 0"):
        warmup_scale(rows[2:], 2, str(path))
    runs = setup(0).runs(MATCHED)
    assert runs and {r.seed for r in runs} == {1} and len(runs) == len(setup(0).runs("real")) // 2
    with pytest.raises(SystemExit) as exc:
        main(["--match-steps", "--seeds", "1", "--dry-run"])
    assert exc.value.code == 2 and "--match-steps" in capsys.readouterr().err
    held = [{**row(side, 0, ttft, 5.0, policy), "seed": seed} for side in ("real", "sim-together")
            for seed in (1, 2) for ttft, policy in ((20.0, "prefix_affinity"), (30.0, "round_robin"))] + [
        {**row(MATCHED, 0, ttft, 5.5, policy), "seed": seed} for seed in (1, 2)
        for ttft, policy in ((20.0, "prefix_affinity"), (30.0, "round_robin"))] + [
        row("real", 0, 30.0, 9.0), row("sim-together", 0, 20.0, 5.0)]
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in held) + "\n")
    text = report(tmp_path, {"capacity_real_mix": 18.0, "matched_scale": 1.06, "replica_model_together": str(path)})
    assert f"## `{MATCHED}`: steps matched to the real engines' own in the seed-0 runs" in text
    assert "its steps scaled by 1.06 x:" in text  # a run directory from before the factor per workload
    text = report(tmp_path, {"capacity_real_mix": 18.0, "matched_scale": {"mix": 1.06, "sharegpt": 1.5},
                             "replica_model_together": str(path)})
    assert "its steps scaled by 1.06 x (mix), 1.50 x (sharegpt):" in text
    assert "`sim-together` (seeds after the first): median absolute error over all rows: ttft_p50 0%" in text
    assert f"`{MATCHED}` (seeds after the first): median absolute error over all rows: ttft_p50 0%, ttft_p99 0%, " \
           "tpot_p50 10%" in text
    # the ranking on the held seeds: both real seeds put round robin's tail above the default's, and so does it
    assert f"## Is the real ranking decided? (`{MATCHED}`)" in text
    assert f"`{MATCHED}` orders 1 of the 1 decided pairs as the real side does." in text


def test_the_paired_side_runs_each_run_at_its_real_twins_own_step_speed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real run stepping 10 ms where the model gives 9.0 at its batch: its simulated twin runs at 1.11 x. A run
    without vLLM's counters cannot be paired (an error naming it); the side needs the together calibration; the
    report says the scales and sets the side against the real one."""
    from bench.sim_vs_real import PAIRED, main
    from bench.sim_vs_real_steps import run_scale

    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())
    assert run_scale(_stepped("real", 2000, 16000, 20000), 2, str(path)) == pytest.approx(10 / 9)
    with pytest.raises(ValueError, match="sharegpt/0.8/0/round_robin has no vLLM step counters"):
        run_scale({**_stepped("real", 1, 1, 1), "engine": None}, 2, str(path))
    paired = Setup(**{**setup(0).__dict__, "pair_steps": True})
    assert paired.sides() == ("real", "sim-together", PAIRED)
    assert len(paired.runs(PAIRED)) == len(paired.runs("real"))
    with pytest.raises(SystemExit) as exc:
        main(["--pair-steps", "--calibrations", "", "--dry-run"])
    assert exc.value.code == 2 and "--pair-steps" in capsys.readouterr().err
    rows = [row("real", 0, 20.0, 5.0), row("sim-together", 0, 15.0, 4.0), {**row(PAIRED, 0, 19.0, 5.0), "scale": 1.2}]
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = report(tmp_path, {"capacity_real_mix": 18.0, "replica_model_together": str(path)})
    assert f"## `{PAIRED}`: each run at its real twin's own step speed" in text
    assert "1.20-1.20 x, median 1.20" in text
    assert f"`{PAIRED}`: median absolute error over all rows: ttft_p50 5%" in text


def test_ttft_splits_into_the_gateway_the_api_server_the_queue_and_prefill() -> None:
    """vLLM's request timings over a run (sum and count deltas) give each part's mean; the client's TTFT less the
    API server's is what lies outside the replica. A run without the histograms is left out."""
    from bench.sim_vs_real_ttft import COUNTERS, split, ttft_lines, ttft_parts

    before = dict.fromkeys(COUNTERS, 0.0)
    after = {**before, "vllm:time_to_first_token_seconds_sum": 0.12, "vllm:time_to_first_token_seconds_count": 4,
             "vllm:request_queue_time_seconds_sum": 0.04, "vllm:request_queue_time_seconds_count": 4,
             "vllm:request_prefill_time_seconds_sum": 0.06, "vllm:request_prefill_time_seconds_count": 4}
    parts = ttft_parts(before, after)
    assert parts == pytest.approx({"engine_ttft_s": 0.03, "queue_s": 0.01, "prefill_s": 0.015})
    assert math.isnan(ttft_parts(before, before)["queue_s"])
    row = {"side": "real", "workload": "mix", "arrival": "poisson", "load": 0.95, "seed": 0, "policy": "round_robin",
           "ttft_s": [0.03, 0.05], "engine": {"ttft_parts": parts}}
    assert split(row) == pytest.approx((40.0, 10.0, 5.0, 10.0, 15.0))
    assert split({**row, "engine": {}}) is None
    text = "\n".join(ttft_lines([row, {**row, "side": "sim-paired", "ttft_s": [0.035]}], ["real", "sim-paired"]))
    assert "| mix/poisson/0.95 | real | 1 | 40.0 | 10.0 | 5.0 | 10.0 | 15.0 |" in text
    assert "| mix/poisson/0.95 | sim-paired | 1 | 35.0 | 5.0 | 5.0 | 10.0 | 15.0 |" in text


def test_each_simulated_run_is_set_beside_its_real_twin_part_by_part() -> None:
    """The twin of a run shares its workload, arrivals, load, seed and policy: the medians of the differences name
    the parts where a side is short (here 5 ms: 2 outside the replica, 3 in the prefill), and the prefill's ratio;
    a run without a twin or without the timings is left out, a repeat of the real run is not its twin, and no pair
    at all gives no section."""
    from bench.sim_vs_real_ttft import twin_lines

    parts = {"engine_ttft_s": 0.03, "queue_s": 0.01, "prefill_s": 0.015}
    real = {"side": "real", "workload": "mix", "arrival": "poisson", "load": 0.95, "seed": 0, "policy": "round_robin",
            "ttft_s": [0.03, 0.05], "engine": {"ttft_parts": parts}}
    twin = {**real, "side": "sim-paired", "ttft_s": [0.035],
            "engine": {"ttft_parts": {**parts, "prefill_s": 0.012, "engine_ttft_s": 0.027}}}
    lonely = {**twin, "seed": 1}
    again = {**real, "repeat": 1, "ttft_s": [0.5]}  # the real run repeated later: not the twin
    text = "\n".join(twin_lines([real, twin, lonely, {**twin, "policy": "x", "engine": {}}, again], ["sim-paired"]))
    assert "| sim-paired | 1 | -5.0 | -2.0 | +0.0 | +0.0 | -3.0 | 0.80 |" in text
    assert twin_lines([real], ["sim-paired"]) == []


def test_outside_the_replica_is_set_against_the_streams_each_first_token_met() -> None:
    """A first token meets the other requests decoding on its replica then (first token <= t < end): here 0, 1 and
    0 (the third on another replica); each side's runs get a least-squares line of their time outside the replica
    against that count (runs of 1, 2 and 3 streams at 5 + 1 ms a stream give exactly that line), and a side with
    fewer than three runs none."""
    from bench.sim_vs_real_ttft import outside_lines, streams_met

    row = {"firsts": [[0.0, 0.1, 128, "a"], [0.2, 0.1, 128, "a"], [0.2, 0.1, 128, "b"]], "e2e_s": [1.0, 1.0, 1.0]}
    assert streams_met(row) == pytest.approx(1 / 3)
    assert streams_met({"firsts": [], "e2e_s": []}) is None

    def run(streams: int) -> dict[str, object]:
        # `streams` + 1 requests sent together on one replica, each first token meeting the others decoding
        firsts = [[0.0, 0.01, 128, "a"]] * (streams + 1)
        outside = (5 + streams) / 1e3
        return {"side": "real", "workload": "mix", "firsts": firsts, "e2e_s": [1.0] * (streams + 1),
                "ttft_s": [0.03 + outside], "engine": {"ttft_parts": {"engine_ttft_s": 0.03, "queue_s": 0.0,
                                                                      "prefill_s": 0.02}}}
    text = "\n".join(outside_lines([run(1), run(2), run(3)], ["real", "sim-paired"]))
    assert "| real | 3 | 1.0-3.0 | 6.0-8.0 | 5.0 | 1.00 | 0.0 |" in text and "sim-paired" not in text
    assert outside_lines([run(1)], ["real"]) == []


def test_the_cpu_twin_burns_what_the_real_replicas_used() -> None:
    """`--cpu-twin` copies the real replicas' median cores (NaN readings left out); a run without them is an
    error; the burners split the cores into whole processes, and a burner spins for its share of the time."""
    import time

    from bench.cpu_twin import burn, burners
    from bench.sim_vs_real import twin_cores

    rows = [{"side": "real", "cpu": {"replicas": [0.7, 0.8]}}, {"side": "real", "cpu": {"replicas": [0.7, math.nan]}},
            {"side": "real", "cpu": {"replicas": [0.75, 0.75]}}, {"side": "sim-paired", "cpu": {"replicas": [0.1]}}]
    assert twin_cores(rows) == 1.5
    with pytest.raises(RuntimeError, match="no real run"):
        twin_cores(rows[3:])
    assert burners(1.5) == (2, 0.75) and burners(0.3) == (1, 0.3)
    with pytest.raises(ValueError, match="cores to burn"):
        burners(0.0)
    started, cpu = time.monotonic(), time.process_time()
    burn(0.5, seconds=0.4)
    share = (time.process_time() - cpu) / (time.monotonic() - started)
    assert 0.3 < share < 0.8, share


def test_the_report_opens_with_each_side_against_the_goals_and_the_machines_speed(tmp_path: Path) -> None:
    """Two policies, two seeds. `sim-together` 22% fast on TTFT p50 (a miss: 24 and 20 ms against 31 and 25.5
    pooled), within the other goals, and orders
    the pair both real seeds decide (round robin ahead) as they do; `sim-paired` within every goal. The real
    engines stepped 10 ms at a batch where the model gives 9.0 (1.11 x) in one seed and 9.9 ms (1.10 x) in the
    other: more than 10% from the calibration, so the report says the machine moved."""
    from bench.sim_vs_real import PAIRED
    from bench.sim_vs_real_goals import GOALS, median_errors, speed_ratios

    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())

    def at(side: str, seed: int, policy: str, ttft_ms: float, tpot_ms: float, steps: float) -> dict[str, object]:
        figures = row(side, 0, ttft_ms, tpot_ms, policy)
        key = Run(side, "mix", "poisson", 0.5, seed, policy).__dict__
        return {**figures, **key, "engine": {"steps": steps, "tokens": 36000.0, "generated": 16000.0 * steps / 2000,
                                             "prompt": 20000.0 * steps / 2000, "span_s": 10.0}}

    rows = [at("real", 0, "prefix_affinity", 30.0, 5.0, 2000), at("real", 0, "round_robin", 25.0, 5.0, 2000),
            at("real", 1, "prefix_affinity", 32.0, 5.0, 2020), at("real", 1, "round_robin", 26.0, 5.0, 2020),
            at("sim-together", 0, "prefix_affinity", 24.0, 5.2, 2000),
            at("sim-together", 0, "round_robin", 20.0, 5.2, 2000),
            at(PAIRED, 0, "prefix_affinity", 31.0, 5.1, 2000), at(PAIRED, 0, "round_robin", 25.5, 5.1, 2000)]
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pooled = summarize(rows)
    errors, n = median_errors(pooled["real"], pooled["sim-together"])
    assert n == 2 and set(errors) == set(GOALS) and errors["ttft_p50"] == pytest.approx(0.2207, abs=0.001)
    ratios = speed_ratios(rows, 2, str(path))
    assert len(ratios) == 4 and all(1.09 < x < 1.12 for x in ratios)
    assert speed_ratios(rows, 2, str(tmp_path / "none.json")) == []
    text = report(tmp_path, {"capacity_real_mix": 18.0, "replica_model_together": str(path)})
    goals = text.split("## The goals")[1].split("\n## ")[0]
    assert text.index("## The goals") < text.index("## Real against")
    together = next(line for line in goals.splitlines() if line.startswith("| `sim-together`"))
    paired = next(line for line in goals.splitlines() if line.startswith(f"| `{PAIRED}`"))
    assert "22% *" in together and together.endswith("| 1 of 1 | no |")
    assert "*" not in paired and paired.endswith("| 1 of 1 | yes |") and "an oracle" in paired
    assert "stepped 1.11 x the calibrated model" in goals and "the machine did not hold the speed" in goals


def test_the_goals_are_split_by_traffic_where_a_run_has_several(tmp_path: Path) -> None:
    """Poisson and bursts, two policies, two seeds. The simulator is 4% slow on every Poisson figure and 30% fast
    on every bursty one: over all rows the medians sit between the two (a miss on TTFT p50), per traffic Poisson
    meets every goal and bursts miss. The engines stepped 1.0 x the model under Poisson and 1.2 x under bursts."""
    from bench.sim_vs_real_goals import goals_lines, median_errors, traffic_of

    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())

    def at(side: str, arrival: str, seed: int, policy: str, scale: float, steps: float) -> dict[str, object]:
        base = 25.0 if policy == "round_robin" else 30.0 + seed
        figures = row(side, 0, base * scale, 5.0 * scale, policy)
        return {**figures, **Run(side, "mix", arrival, 0.5, seed, policy).__dict__,
                "engine": {"steps": steps, "tokens": 36000.0 * steps / 2000, "generated": 16000.0 * steps / 2000,
                           "prompt": 20000.0 * steps / 2000, "span_s": 10.0}}

    rows = []
    for arrival, sim_scale, steps in (("poisson", 1.04, 2222), ("gamma", 0.7, 1852)):  # 1.0 and 1.2 x the model
        for seed in (0, 1):
            for policy in ("prefix_affinity", "round_robin"):
                rows += [at("real", arrival, seed, policy, 1.0, steps), at("sim-together", arrival, seed, policy,
                                                                           sim_scale, steps)]
    pooled = summarize(rows)
    assert traffic_of("mix/gamma/0.8") == "mix/gamma"
    assert median_errors(pooled["real"], pooled["sim-together"], "mix/poisson")[0]["ttft_p50"] == pytest.approx(0.04)
    assert median_errors(pooled["real"], pooled["sim-together"], "mix/gamma")[1] == 2
    text = "\n".join(goals_lines([("sim-together", "together", rows, pooled)], rows, 2, str(path)))
    overall, split = text.split("By traffic")
    assert "| `sim-together` (together) | 4 | 17% * |" in overall and overall.count("| no |") == 1
    poisson = next(line for line in split.splitlines() if line.startswith("| mix/poisson"))
    gamma = next(line for line in split.splitlines() if line.startswith("| mix/gamma"))
    assert poisson.startswith("| mix/poisson | `sim-together` | 1.00 (1.00-1.00) | 2 | 4% | 4% | 4% | 4% |")
    assert poisson.endswith("| 1 of 1 | yes |") and "*" not in poisson
    assert gamma.startswith("| mix/gamma | `sim-together` | 1.20 (1.20-1.20) | 2 | 30% * |")
    assert gamma.endswith("| 1 of 1 | no |")
    one = [r for r in rows if r["arrival"] == "poisson"]
    assert "By traffic" not in "\n".join(goals_lines([("sim-together", "together", one, summarize(one))], one, 2,
                                                     str(path)))


def test_prompt_tokens_a_step_are_those_computed_not_the_whole_prompts_vllm_counts() -> None:
    """Multi-turn chat: vLLM's `vllm:prompt_tokens` counted 152,026 prompt tokens, 59% of them found in the prefix
    cache; its steps computed 61,658 of them (iteration tokens less the tokens sampled). The step model is priced on
    those, 2.5 x fewer: at 60 tokens a step it gives 3 ms less than at 150 (50 us a token)."""
    from bench.sim_vs_real_steps import step_ratio

    chat = {"side": "real", "workload": "chat", "arrival": "poisson", "load": 1.5, "policy": "prefix_affinity",
            "seed": 0, "engine": {"steps": 1000.0, "tokens": 61658.0 + 3000.0, "generated": 3000.0,
                                  "prompt": 152026.0, "span_s": 5.0}}
    sampled, ms, prompt = per_run(chat, 2)
    assert (sampled, ms, prompt) == (3.0, 10.0, pytest.approx(61.658))
    at_computed = 5.0 + 7.5 * 2 / 15 + 0.05 * 61.658  # step(3) + prefill of the tokens computed, ms
    assert step_ratio(chat, 2, MODEL) == pytest.approx(10.0 / at_computed)


def test_the_figure_draws_each_simulated_side_against_the_real_one(tmp_path: Path) -> None:
    """A row per simulated side the run has (`real-repeat` and chat points are not drawn); none: no figure."""
    from bench.sim_vs_real import PAIRED

    rows = [row("real", 0, 30.0, 5.0), row("real", 0, 25.0, 5.0, "round_robin"), row(REPEAT, 1, 20.0, 6.0),
            row(PAIRED, 0, 31.0, 5.1), row(PAIRED, 0, 25.5, 5.1, "round_robin"),
            row("sim-together", 0, 24.0, 5.2), row("sim-together", 0, 20.0, 5.2, "round_robin")]
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    assert plot(summarize(rows), paths) == ["sim-together", PAIRED]
    assert all(p.stat().st_size > 20_000 for p in paths)
    assert plot(summarize(rows[:3]), [tmp_path / "none.png"]) == [] and not (tmp_path / "none.png").exists()


def test_pairs_a_step_are_estimated_from_the_prompts_and_the_hit_rate() -> None:
    """Prompts of 128 and 1,024 tokens over 100 steps: (128^2 + 1024^2) / 2 / 100 pairs a step with no cache hit,
    3/4 of that at a hit rate of 1/2 (each prompt half cached: p/2 computed after p/2); the model prices them."""
    from bench.sim_vs_real_steps import model_ms, pairs_a_step

    row = {"firsts": [[0.1, 0.04, 128, "r0"], [0.2, 0.05, 1024, "r1"]], "hit_rate": 0.0,
           "engine": {"steps": 100.0}}
    assert pairs_a_step(row) == pytest.approx((128**2 + 1024**2) / 2 / 100)
    assert pairs_a_step({**row, "hit_rate": 0.5}) == pytest.approx(0.75 * pairs_a_step(row))
    assert pairs_a_step({**row, "hit_rate": math.nan}) == pairs_a_step(row)
    assert pairs_a_step({"engine": {"steps": 100.0}}) == 0.0 and pairs_a_step({**row, "engine": None}) == 0.0
    priced = replace(MODEL, prefill_s_per_pair=100e-9)
    assert model_ms(priced, 4, 10, None, 5000) - model_ms(MODEL, 4, 10) == pytest.approx(0.5)


def test_the_calibration_asks_sim_calibrate_for_the_front_ends_latency_only_when_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--frontend-latency` reaches `sim calibrate` as its flag; without it the command is the serial-only one the
    grid judged."""
    import subprocess

    from bench import sim_vs_real_calibration as cal

    calls: list[list[str]] = []

    def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, "fitted", "")

    monkeypatch.setattr(cal.subprocess, "run", run)
    for latency in (False, True):
        assert cal.calibrate(tmp_path, ["p"], 2, "_together", [0], 32, "tok", tmp_path / "m.json",
                             frontend_latency=latency) == "fitted"
    assert "--frontend-latency" not in calls[0] and "--frontend-latency" in calls[1]
    cal.calibrate(tmp_path, ["p"], 2, "_together", [0], 32, "tok", tmp_path / "m.json", core_work=True)
    assert "--core-work" in calls[2] and not any("--core-work" in c for c in calls[:2])
    assert calls[1][calls[1].index("calibrate") + 1:calls[1].index("--out")] == [
        "--profile", str(cal.profile_dir(tmp_path, "p", "_together", 0, 0, 2))]


def test_the_fixed_side_runs_every_run_of_a_workload_at_one_speed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--fixed-speed median`: the median of the real runs' own step speeds over the model (10 / 9 and 12 / 9 ms:
    1.22 x); a number is taken as given; a run without counters is left out of the median, a workload with none is
    an error. The side needs the together calibration and a positive number or median. The report sets each
    point's p99 on the real side, the paired side and the fixed one beside the twins' speeds, and gives item 3's
    rule on the fixed side."""
    from bench.sim_vs_real import FIXED, PAIRED, main
    from bench.sim_vs_real_steps import fixed_scales

    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())
    slow = _stepped("real", 2000, 16000, 20000)
    slower = {**slow, "engine": {**slow["engine"], "span_s": slow["engine"]["span_s"] * 1.2}}
    rows = [slow, slower, {**slow, "engine": None}, {**slow, "workload": "chat"}]
    assert fixed_scales(rows, 2, str(path), "median") == {"sharegpt": pytest.approx(11 / 9)}
    assert fixed_scales(rows, 2, str(path), "1.5") == {"sharegpt": 1.5}
    with pytest.raises(ValueError, match="no real run of sharegpt with vLLM's step counters"):
        fixed_scales(rows[2:], 2, str(path), "median")
    fixed = Setup(**{**setup(0).__dict__, "pair_steps": True, "fixed_speed": "median"})
    assert fixed.sides() == ("real", "sim-together", PAIRED, FIXED)
    assert len(fixed.runs(FIXED)) == len(fixed.runs("real"))
    for argv, message in ((["--fixed-speed", "median", "--calibrations", ""], "add together to --calibrations"),
                          (["--fixed-speed", "fast"], "median or a positive number, got 'fast'"),
                          (["--fixed-speed", "0"], "median or a positive number, got '0'")):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--dry-run"])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    main(["--fixed-speed", "1.1", "--dry-run", "--seeds", "1", "--workloads", "mix", "--loads", "0.5",
          "--chat-rates", ""])
    assert f"{FIXED}/mix/poisson/0.5/0/prefix_affinity" in capsys.readouterr().out
    rows = [row("real", 0, 20.0, 5.0), row("real", 0, 40.0, 5.0, "round_robin"),
            {**row(PAIRED, 0, 19.0, 5.0), "scale": 1.1}, {**row(PAIRED, 0, 42.0, 5.0, "round_robin"), "scale": 1.3},
            {**row(FIXED, 0, 30.0, 5.0), "scale": 1.2}, {**row(FIXED, 0, 31.0, 5.0, "round_robin"), "scale": 1.2}]
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = report(tmp_path, {"capacity_real_mix": 18.0, "replica_model_together": str(path),
                             "fixed_scale": {"mix": 1.2}})
    assert f"## `{FIXED}`: every run at one speed" in text and "(mix 1.20 x)" in text
    assert "| mix/poisson/0.5 | prefix_affinity | 20 | 19 | 30 | 1.10-1.10 |" in text
    assert "| mix/poisson/0.5 | round_robin | 40 | 42 | 31 | 1.30-1.30 |" in text
    section = text.split(f"Item 3's rule on `{FIXED}`:")[1]
    assert "Over 1 point: prefix_affinity, round_robin meet it." in section.split("##")[0]
    assert "are netted of what the step measurement adds" not in text  # a run directory from before the netting
    text = report(tmp_path, {"capacity_real_mix": 18.0, "replica_model_together": str(path),
                             "fixed_scale": {"mix": 1.2}, "overcount": {"mix": 1.04}})
    assert "are netted of what the step measurement adds on simulated engines at scale 1" in text
    assert "the median over `sim-together`'s runs of their measured step over the model, mix 1.040 x." in text


def test_run_by_run_sets_each_real_run_by_its_speed_and_correlates_its_tail_with_it(tmp_path: Path) -> None:
    """Three seeds of one point, each real run's engines at 10 ms a step where the model gives 9.0 at their batch,
    times its span: 1.00, 1.20 and 1.10 x the model. The slower the run, the longer its tail: rank correlation
    +1.00, the slowest run first, its twins beside it; a twin that did not run leaves its cell empty, and a run
    without vLLM's counters is left out. Three policies of one seed at 1.0 / 1.2 / 1.1 x with tails of 30 / 20 /
    40 ms: -0.50 within the seed, and the slowest run's tail not the longest. Nothing without the model."""
    from bench.sim_vs_real import FIXED, PAIRED
    from bench.sim_vs_real_report import run_by_run_lines

    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())
    engine = _stepped("real", 2000, 16000, 20000)["engine"]
    rows: list[dict[str, object]] = [{**row("real", 0, 99.0, 5.0), "seed": 3}]
    for seed, (speed, ms) in enumerate(((1.0, 30.0), (1.2, 50.0), (1.1, 40.0))):
        rows += [{**row("real", 0, ms, 5.0), "seed": seed, "engine": {**engine, "span_s": 9.0 * speed}},
                 {**row(PAIRED, 0, ms + 1, 5.0), "seed": seed, "scale": speed}]
        rows += [{**row(FIXED, 0, 35.0, 5.0), "seed": seed, "scale": 1.1}] if seed else []
    text = "\n".join(run_by_run_lines(rows, 2, str(path)))
    assert text.index("| mix/poisson/0.5 | 1 | prefix_affinity | 1.20 | 50 | 51 | 35 |") < text.index(
        "| mix/poisson/0.5 | 2 | prefix_affinity | 1.10 | 40 | 41 | 35 |") < text.index(
        "| mix/poisson/0.5 | 0 | prefix_affinity | 1.00 | 30 | 31 |  |")
    assert "| 3 | prefix_affinity" not in text
    assert "| mix/poisson/0.5 | 3 | +1.00 |  |  |" in text  # one run a seed: no seed to look within
    policies = ("round_robin", "least_requests", "prefix_affinity")
    within = [{**row("real", 0, ms, 5.0, policy), "engine": {**engine, "span_s": 9.0 * speed}}
              for policy, speed, ms in zip(policies, (1.0, 1.2, 1.1), (30.0, 20.0, 40.0))]
    text = "\n".join(run_by_run_lines(within, 2, str(path)))
    assert "| mix/poisson/0.5 | 3 | -0.50 | -0.50 | 0 of 1 |" in text
    assert run_by_run_lines(rows, 2, None) == []


def test_the_scales_read_from_real_runs_are_netted_of_what_the_measurement_adds_on_a_simulated_engine(
        tmp_path: Path) -> None:
    """The step measurement (busy time / steps) reads 10 ms on simulated engines at scale 1 whose model gives 9.0:
    it adds 1.11 x, the front end's time between steps; a simulated run at scale 1.5 reading 15 ms adds the same.
    Real runs and other sides do not count; chat has its own; a scale read from a real run is divided by it, per
    workload, and a workload with no simulated run at scale 1 is an error naming it."""
    from bench.sim_vs_real_steps import net_of, overcounts

    path = tmp_path / "replica.json"
    path.write_text(MODEL.to_json())
    at_one = _stepped("sim-together", 2000, 16000, 20000)
    scaled = {**at_one, "scale": 1.5, "engine": {**at_one["engine"], "span_s": 15.0}}
    rows = [at_one, scaled, {**at_one, "side": "real", "engine": {**at_one["engine"], "span_s": 20.0}},
            {**at_one, "workload": "chat", "engine": {**at_one["engine"], "span_s": 20.0}},
            {**at_one, "side": "sim-paired", "engine": {**at_one["engine"], "span_s": 20.0}}]
    over = overcounts(rows, 2, str(path), "sim-together")
    assert over == {"chat": pytest.approx(20 / 9), "sharegpt": pytest.approx(10 / 9)}
    assert net_of({"sharegpt": 1.5}, over) == {"sharegpt": pytest.approx(1.5 * 0.9)}
    with pytest.raises(ValueError, match="no simulated run at scale 1 of mix"):
        net_of({"mix": 1.2, "sharegpt": 1.5}, over)
