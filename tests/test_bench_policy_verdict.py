"""`bench.policy_verdict`: the real side of several `bench.sim_vs_real` runs pooled per point, then item 3's rule
(on made-up run directories, and on the real runs kept in docs/bench; fast)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench.policy_verdict import (interval_lines, main, paired_ratios, pooled, pooled_in_steps, read, seed_by_seed,
                                   seed_means, verdict)

BENCH = Path(__file__).resolve().parent.parent / "docs" / "bench"


def _row(policy: str, seed: int, ttft_ms: list[float], side: str = "real", load: float = 0.5,
         workload: str = "mix", tpot_ms: float = 5.0) -> dict[str, object]:
    return {"side": side, "workload": workload, "arrival": "poisson", "load": load, "policy": policy, "seed": seed,
            "ttft_s": [t / 1000 for t in ttft_ms], "tpot_s": [tpot_ms / 1000], "e2e_s": [0.5], "hit_rate": 0.0,
            "failed": 0}


def _run_dir(path: Path, rows: list[dict[str, object]]) -> Path:
    path.mkdir()
    (path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_runs_of_several_directories_are_pooled_per_point_and_judged(tmp_path: Path) -> None:
    """The default's 98 requests at 20 ms and 3 at 500 in the first run (p99 500 ms alone), 300 at 20 in the
    second: pooled over 401 requests its p99 is 20 ms; round robin's are all 21 ms. Simulated and chat rows are
    left out."""
    first = _run_dir(tmp_path / "a", [_row("prefix_affinity", 0, [20] * 98 + [500] * 3),
                                      _row("round_robin", 0, [21] * 101),
                                      _row("prefix_affinity", 0, [1] * 10, side="sim-together"),
                                      _row("prefix_affinity", 0, [900] * 10, workload="chat")])
    second = _run_dir(tmp_path / "b", [_row("prefix_affinity", 0, [20] * 300), _row("round_robin", 0, [21] * 300)])
    table = pooled(read([first, second]))
    assert list(table) == ["mix/poisson/0.5"]
    p99, seeds, requests = table["mix/poisson/0.5"]["prefix_affinity"]
    assert (seeds, requests) == (2, 401) and p99 == pytest.approx(20.0)
    # alone, the first run's slow requests set its p99
    assert pooled(read([first]))["mix/poisson/0.5"]["prefix_affinity"][0] > 400
    text = verdict([first, second])
    assert "| mix/poisson/0.5 | 20 (2, 401) | 21 (2, 401) |" in text
    assert "Over 1 point: prefix_affinity, round_robin meet it." in text  # 21 ms is within 10% of 20
    # seed by seed: the default's p99 is higher in the first directory (500 ms), lower in the second
    assert seed_by_seed(read([first, second])) == {"mix/poisson/0.5": {"round_robin": (1, 1)}}
    assert "| mix/poisson/0.5 | 1 of 2 |" in text and "| all | **1 of 2** |" in text


def test_in_engine_steps_a_slow_minute_divides_out(tmp_path: Path) -> None:
    """Round robin ran in a minute when the machine was 1.5 x slower: its TTFTs (30 ms) and its TPOT (7.5 ms) both
    1.5 x the default's (20 ms, 5 ms). In ms the default meets the goal and round robin does not; in steps (4 each)
    both do."""
    run = _run_dir(tmp_path / "a", [_row("prefix_affinity", 0, [20] * 100),
                                    _row("round_robin", 0, [30] * 100, tpot_ms=7.5)])
    steps = pooled_in_steps(read([run]))
    assert steps == {"mix/poisson/0.5": {"prefix_affinity": pytest.approx(4.0), "round_robin": pytest.approx(4.0)}}
    text = verdict([run])
    in_ms, in_steps = text.split("In engine steps")
    assert "Over 1 point: prefix_affinity meets it." in in_ms
    assert "| mix/poisson/0.5 | 4.0 | 4.0 |" in in_steps
    assert "Over 1 point: prefix_affinity, round_robin meet it." in in_steps


def test_a_runs_file_kept_gzipped_counts_as_its_directory(tmp_path: Path) -> None:
    """A run's rows kept as docs/bench keeps them (runs.jsonl gzipped, or plain) read as its directory does, each
    file's seeds units of their own: the same pooled table, and seed by seed one unit per file."""
    rows = [_row("prefix_affinity", 0, [20] * 98 + [500] * 3), _row("round_robin", 0, [21] * 101)]
    run = _run_dir(tmp_path / "a", rows)
    kept = tmp_path / "runs_a.jsonl.gz"
    kept.write_bytes(gzip.compress((run / "runs.jsonl").read_bytes()))
    assert read([kept]) == read([run]) == read([run / "runs.jsonl"])
    assert seed_by_seed(read([kept, run])) == {"mix/poisson/0.5": {"round_robin": (0, 2)}}
    assert verdict([kept]).split("\n", 1)[1] == verdict([run]).split("\n", 1)[1]


@pytest.mark.parametrize("kept", sorted(BENCH.glob("runs_*.jsonl.gz")), ids=lambda p: p.name)
def test_the_rows_kept_in_docs_give_the_verdict_beside_them(kept: Path) -> None:
    """Each real run kept in docs/bench (runs_NAME.jsonl.gz) gives, read again, the verdict its page quotes
    (policy_verdict_NAME.md, whose first lines say how it was made): the figures in the docs are the rows'."""
    page = BENCH / ("policy_verdict_" + kept.name.removeprefix("runs_").removesuffix(".jsonl.gz") + ".md")
    body = verdict([kept])
    assert body.startswith("Real vLLM-CPU, p99 TTFT") and body in page.read_text()


def test_a_directory_without_runs_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path)])
    assert exc.value.code == 2 and "no runs.jsonl" in capsys.readouterr().err
    empty = _run_dir(tmp_path / "sim-only", [_row("round_robin", 0, [5], side="sim-together")])
    with pytest.raises(SystemExit) as exc:
        main([str(empty)])
    assert exc.value.code == 2 and "no real single-turn runs" in capsys.readouterr().err


def test_the_pooled_ratios_come_with_an_interval_from_resampling_seeds(tmp_path: Path) -> None:
    """Round robin 3 x slower than the default in each of 5 seeds: the ratio and its interval stay below 1.
    `least_requests` level in 5 seeds and slow in none, but the default had one slow seed: pooled the default is
    past 1.10 x it, yet resampling the seeds reaches back to 1.0 (inside the noise). A seed where only the default
    ran is not paired with anything."""
    rows = []
    for seed in range(5):
        rows += [_row("prefix_affinity", seed, [20] * 100), _row("round_robin", seed, [60] * 100),
                 _row("least_requests", seed, [20] * 100)]
    rows[0] = _row("prefix_affinity", 0, [20] * 90 + [40] * 10)  # seed 0: the default's slow tail
    rows.append(_row("prefix_affinity", 9, [20] * 100))
    run = _run_dir(tmp_path / "a", rows)
    ratios = paired_ratios(read([run]))["mix/poisson/0.5"]
    rr, lr = ratios["round_robin"], ratios["least_requests"]
    assert rr.seeds == lr.seeds == 5
    assert rr.ratio == pytest.approx(40 / 60) and rr.high == pytest.approx(40 / 60)  # the slow seed sets p99
    assert rr.low == pytest.approx(20 / 60)  # drawn without it
    assert lr.ratio == pytest.approx(2.0) and lr.low == pytest.approx(1.0) and lr.high == pytest.approx(2.0)
    text = "\n".join(interval_lines({"mix/poisson/0.5": ratios}))
    assert "| mix/poisson/0.5 | 2.00 (1.00-2.00; 5) | 0.67 (0.33-0.67; 5) |" in text
    assert "past item 3's marks (within 1.10 x each policy, at most 1.00 x round robin) at: no point." in text
    assert "inside the seeds' noise: mix/poisson/0.5 against least_requests (2.00 x, 1.00-2.00)." in text


def test_a_policy_slower_in_every_seed_is_shown_past_the_mark(tmp_path: Path) -> None:
    rows = [r for seed in range(4) for r in (_row("prefix_affinity", seed, [30 + seed] * 100),
                                             _row("round_robin", seed, [20 + seed] * 100))]
    ratios = paired_ratios(read([_run_dir(tmp_path / "a", rows)]))
    assert ratios["mix/poisson/0.5"]["round_robin"].low > 1.3
    assert "at: mix/poisson/0.5 against round_robin" in "\n".join(interval_lines(ratios))


def test_the_typical_seed_is_a_geometric_mean_over_seeds_where_one_seed_is_one_term(tmp_path: Path) -> None:
    """Seed by seed the default is 2 x round robin, then 0.5 x, then level twice: the typical seed is 1.0 x, its
    interval inside 0.5-2. Pooled, the seed at 40 ms sets the default's p99 (40 against 20): 2 x. A point with a
    single shared seed gets no mean."""
    rows = [_row("prefix_affinity", 0, [40] * 100), _row("round_robin", 0, [20] * 100),
            _row("prefix_affinity", 1, [10] * 100), _row("round_robin", 1, [20] * 100),
            *(r for seed in (2, 3) for r in (_row("prefix_affinity", seed, [20] * 100),
                                             _row("round_robin", seed, [20] * 100))),
            _row("prefix_affinity", 0, [20] * 100, load=0.8), _row("round_robin", 0, [30] * 100, load=0.8)]
    runs = read([_run_dir(tmp_path / "a", rows)])
    means = seed_means(runs)
    assert list(means) == ["mix/poisson/0.5"]
    typical = means["mix/poisson/0.5"]["round_robin"]
    assert typical.seeds == 4 and typical.ratio == pytest.approx(1.0)
    assert 0.5 <= typical.low < 1.0 < typical.high <= 2.0
    assert paired_ratios(runs)["mix/poisson/0.5"]["round_robin"].ratio == pytest.approx(2.0)
    text = verdict([tmp_path / "a"])
    assert "The typical seed: the geometric mean" in text
    assert f"| mix/poisson/0.5 | 1.00 ({typical.low:.2f}-{typical.high:.2f}; 4) |" in text


def test_with_a_replica_model_each_directorys_runs_are_set_beside_their_speed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of one seed whose engines stepped 10 and 12 ms where the model gives 9.0 ms at their batch (8
    sequences, 10 prompt tokens a step): 1.11 and 1.33 x, the slower one first, beside their p99s. A directory
    without step counters says so; a missing model file is a usage error."""
    from sim.measured import ReplicaModel

    model = ReplicaModel(model_name="m", step_s=((1, 0.005), (16, 0.0125)), prefill_s_per_token=50e-6,
                         frontend_s=0.0, max_num_seqs=32, max_num_batched_tokens=2048, chunked_prefill=True,
                         prefix_caching=True, block_size=128, num_blocks=100, max_model_len=2048)
    path = tmp_path / "replica.json"
    path.write_text(model.to_json())

    def stepped(policy: str, ms: float, span_s: float) -> dict[str, object]:
        return {**_row(policy, 0, [ms] * 100), "engine": {"steps": 2000, "tokens": 36000, "generated": 16000,
                                                          "prompt": 20000, "span_s": span_s}}
    run = _run_dir(tmp_path / "a", [stepped("prefix_affinity", 20, 10.0), stepped("round_robin", 300, 12.0)])
    (run / "meta.json").write_text(json.dumps({"replicas": 2}))
    bare = _run_dir(tmp_path / "b", [_row("prefix_affinity", 0, [20] * 100)])
    text = verdict([run, bare], path)
    mine = text.split(f"### {run}, run by run (2 replicas")[1]
    assert mine.index("| mix/poisson/0.5 | 0 | round_robin | 1.33 | 300 |\n") < mine.index(
        "| mix/poisson/0.5 | 0 | prefix_affinity | 1.11 | 20 |\n")  # no simulated side: no column for one
    assert "No run with vLLM's step counters." in text.split(f"### {bare}, run by run")[1]
    with pytest.raises(SystemExit) as exc:
        main([str(run), "--replica-model", str(tmp_path / "none.json")])
    assert exc.value.code == 2 and "none.json: no such file" in capsys.readouterr().err
