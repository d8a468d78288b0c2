"""`bench.route_choices`: each replica's outstanding tokens rebuilt from the client's timings, and the share of
requests sent to the one with the fewest (on made-up runs with a known answer, and on real runs kept in docs/bench;
fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.route_choices import Flight, flights, main, shares, to_fewest

BENCH = Path(__file__).resolve().parent.parent / "docs" / "bench"
A, B = "http://127.0.0.1:18010", "http://127.0.0.1:18011"


def _row(policy: str, requests: list[tuple[float, float, int, str, float, int]], seed: int = 0,
         side: str = "real") -> dict[str, object]:
    """requests: (sent, TTFT, prompt, replica, E2E, output tokens), as bench.sim_vs_real records them."""
    return {"side": side, "workload": "mix", "arrival": "gamma", "load": 0.8, "policy": policy, "seed": seed,
            "firsts": [[s, t, p, r] for s, t, p, r, _, _ in requests],
            "e2e_s": [e for *_, e, _ in requests],
            "tpot_s": [(e - t) / (o - 1) for _, t, _, _, e, o in requests], "ttft_s": [t for _, t, *_ in requests]}


def test_a_request_holds_its_prompt_until_its_first_token_then_counts_its_output_down() -> None:
    f = Flight(sent=1.0, first=1.5, end=3.5, prompt=256, output=64, replica=A)
    assert f.holds(0.9) == 0 and f.holds(3.5) == 0
    assert f.holds(1.0) == f.holds(1.49) == 320
    assert f.holds(1.5) == 64 and f.holds(2.5) == pytest.approx(32)


def test_the_output_length_comes_from_the_runs_own_tpot_and_requests_are_taken_in_send_order() -> None:
    row = _row("round_robin", [(0.3, 0.1, 256, B, 0.73, 44), (0.0, 0.1, 1024, A, 2.65, 256)])
    fl = flights(row)
    assert [(f.sent, f.prompt, f.output, f.replica) for f in fl] == [(0.0, 1024, 256, A), (0.3, 256, 44, B)]
    assert fl[0].first == pytest.approx(0.1) and fl[0].end == pytest.approx(2.65)


def test_rows_that_cannot_say_are_left_out() -> None:
    row = _row("round_robin", [(0.0, 0.1, 256, A, 0.5, 64), (0.1, 0.1, 256, None, 0.5, 64)])
    assert flights(row) is None  # a request without its replica
    row = _row("round_robin", [(0.0, 0.1, 256, A, 0.5, 64)])
    row["tpot_s"] = []  # a request that streamed one token: no TPOT, the lists no longer pair up
    assert flights(row) is None
    assert flights({"firsts": None, "e2e_s": [], "tpot_s": []}) is None


def test_a_follower_of_tokens_and_a_blind_alternator_come_out_at_one_and_at_a_half() -> None:
    """Each request lasts 1 s; a long one (1024 prompt) every fourth. At each send the replica holding the long one
    holds more. `least_outstanding_tokens` sends every request to the lighter one: 1.0. Round robin alternates
    whatever the load, and the long ones, every fourth, all land on A: the odd requests go to B, the lighter (6 of
    the 11 with a choice), the even ones to A, the heavier. The first request had no choice (both idle)."""
    sends = [0.2 * i for i in range(12)]

    def run(policy: str, pick) -> dict[str, object]:
        reqs, held = [], {A: [], B: []}
        for i, s in enumerate(sends):
            load = {r: sum(p for e, p in held[r] if e > s) for r in (A, B)}
            replica = pick(i, load)
            prompt = 1024 if i % 4 == 0 else 64
            held[replica].append((s + 1.0, prompt))
            reqs.append((s, 0.9, prompt, replica, 1.0, 11))  # the prompt held until 0.9 s, then 10 tokens of output
        return _row(policy, reqs)

    fewest = run("least_outstanding_tokens", lambda i, load: min(load, key=lambda r: (load[r], r)))
    alternate = run("round_robin", lambda i, load: (A, B)[i % 2])
    found = {s.policy: s for s in shares([fewest, alternate], margin=40)}
    assert found["least_outstanding_tokens"].share == 1.0
    assert found["least_outstanding_tokens"].had == 11
    assert (found["round_robin"].chose, found["round_robin"].had) == (6, 11)
    # a margin no load reaches leaves no request with a choice
    assert to_fewest(flights(fewest), [A, B], margin=10_000) == (0, 0)


def test_an_idle_replica_is_a_choice_too() -> None:
    """Both requests went to A while B held nothing: the second had B as the fewest and did not take it."""
    row = _row("round_robin", [(0.0, 0.5, 512, A, 1.0, 11), (0.1, 0.5, 512, A, 1.0, 11)])
    assert to_fewest(flights(row), [A, B], margin=40) == (0, 1)


def test_a_simulated_side_is_judged_apart_on_its_own_replicas() -> None:
    """The same schedule on the real side (replicas A, B) and on a simulated one (C, D), both sent to the lighter
    replica: each side's share is 1.0 over its own two replicas (the other side's, idle in its runs, would have been
    the fewest for every request), and the real side comes first."""
    C, D = "http://127.0.0.1:19010", "http://127.0.0.1:19011"
    real = _row("least_outstanding_tokens", [(0.0, 0.5, 512, A, 1.0, 11), (0.1, 0.5, 512, B, 1.0, 11)])
    sim = _row("least_outstanding_tokens", [(0.0, 0.5, 512, C, 1.0, 11), (0.1, 0.5, 512, D, 1.0, 11)],
               side="sim-together")
    found = shares([sim, real])
    assert [(s.side, s.chose, s.had) for s in found] == [("real", 1, 1), ("sim-together", 1, 1)]


def test_the_kept_mix_bursts_runs_show_the_default_following_tokens_as_least_outstanding_tokens_does(
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/routing.md quotes this table (seeds 38-49 at `mix` bursts 80%): the default and
    `least_outstanding_tokens` sent 92% of the requests that had a choice to the lighter replica, round robin 58%."""
    main([str(BENCH / "runs_mix_gamma80_seeds38-49_2026-12-02.jsonl.gz")])
    out = capsys.readouterr().out
    assert "| mix/gamma/0.8 | real | prefix_affinity | 92% | 85%-99% | 12 |" in out
    assert "| mix/gamma/0.8 | real | least_outstanding_tokens | 92% | 88%-98% | 12 |" in out
    assert "| mix/gamma/0.8 | real | round_robin | 58% | 52%-64% | 12 |" in out


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing")])
    assert "no runs.jsonl" in capsys.readouterr().err
    (tmp_path / "runs.jsonl").write_text(json.dumps({"side": "sim-together", "workload": "mix", "arrival": "gamma",
                                                     "load": 0.8, "policy": "round_robin", "seed": 0,
                                                     "repeat": 0}) + "\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "no single-turn run recorded" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--margin", "-1"])
    assert "--margin" in capsys.readouterr().err
