"""bench/sim_vs_real_lengths.py: the report's TTFT by prompt length (made-up runs)."""

from __future__ import annotations

from typing import Any

from bench.sim_vs_real_lengths import after_long, after_long_lines, groups, length_lines


def run(side: str, seed: int, firsts: list[tuple[float, int]], workload: str = "mix") -> dict[str, Any]:
    return {"side": side, "workload": workload, "arrival": "poisson", "load": 0.8, "seed": seed,
            "policy": "prefix_affinity", "repeat": 0,
            "firsts": [[i * 0.1, ttft, prompt, "r0"] for i, (ttft, prompt) in enumerate(firsts)]}


def test_each_length_is_set_against_the_real_one_pooled_over_seeds() -> None:
    """Short prompts right and long ones 20% short: the table says so per length, where the pooled median would
    not; a run without its real twin is left out."""
    rows = []
    for seed in (0, 1):
        real = [(0.050, 128)] * 8 + [(0.200, 1024)] * 2
        rows += [run("real", seed, real), run("sim-together", seed, [(t * (0.8 if n == 1024 else 1.0), n)
                                                                     for t, n in real])]
    rows.append(run("sim-together", 7, [(5.0, 128)]))  # no real run of seed 7
    table = [line for line in "\n".join(length_lines(rows, ["sim-together"])).splitlines() if line.startswith("| mix/")]
    assert table == ["| mix/poisson/0.8 | 128 | sim-together | 16 | 50 | 50 | +0% | 50 | 50 | +0% |",
                     "| mix/poisson/0.8 | 1024 | sim-together | 4 | 200 | 160 | -20% | 200 | 160 | -20% |"]
    assert length_lines(rows, ["sim-paired"]) == []  # no such side: no section
    assert length_lines([run("real", 0, real)], ["sim-together"]) == []


def test_many_lengths_fall_into_halves_about_the_median() -> None:
    names, group_of = groups([100, 200, 300, 400, 500])
    assert names == ["<= 300", "> 300"] and group_of(300) == "<= 300" and group_of(301) == "> 300"
    names, group_of = groups([1024, 128, 128])
    assert names == ["128", "1024"] and group_of(1024) == "1024"
    rows = [run("real", 0, [(0.01 * i, 100 * i) for i in range(1, 7)], "sharegpt"),
            run("sim-paired", 0, [(0.01 * i, 100 * i) for i in range(1, 7)], "sharegpt")]
    table = [line for line in "\n".join(length_lines(rows, ["sim-paired"])).splitlines()
             if line.startswith("| sharegpt")]
    assert [line.split(" | ")[1] for line in table] == ["<= 350", "> 350"]


def test_short_prompts_are_split_by_where_a_long_one_just_before_went() -> None:
    """A 128-token prompt sent 50 ms after a 1,024-token one on its replica, 70 ms after one on another replica,
    or 300 ms after: three rows; the simulated side right alone, 30% short behind a long prompt on its replica and
    10% long after one elsewhere shows as exactly that; the longest length has no row, and a workload of many
    lengths no section."""
    def timed(side: str, behind: float, beside: float) -> dict[str, Any]:
        firsts = []
        for k in range(4):  # every 1 s: a long prompt on r0, a short one on r0 50 ms after, on r1 70 ms, r0 300 ms
            firsts += [[k, 0.200, 1024, "r0"], [k + 0.05, 0.040 * behind, 128, "r0"],
                       [k + 0.07, 0.030 * beside, 128, "r1"], [k + 0.3, 0.020, 128, "r0"]]
        return {**run(side, 0, []), "firsts": firsts}

    assert after_long([[0.0, 0.1, 1024, "a"], [0.05, 0.1, 128, "a"], [0.06, 0.1, 128, "b"], [0.3, 0.1, 128, "a"],
                       [0.0, 0.1, 128, "a"]], 1024) == ["none", "on its replica", "on another replica", "none", "none"]
    text = "\n".join(after_long_lines([timed("real", 1.0, 1.0), timed("sim-paired", 0.7, 1.1)], ["sim-paired"]))
    table = [line for line in text.splitlines() if line.startswith("| mix/")]
    assert [line.split(" | ")[2:] for line in table] == [
        ["none", "sim-paired", "4", "20", "20", "+0%", "20", "20", "+0% |"],
        ["on another replica", "sim-paired", "4", "30", "33", "+10%", "30", "33", "+10% |"],
        ["on its replica", "sim-paired", "4", "40", "28", "-30%", "40", "28", "-30% |"]]
    many = [run(side, 0, [(0.01 * i, 100 * i) for i in range(1, 7)], "sharegpt") for side in ("real", "sim-paired")]
    assert after_long_lines(many, ["sim-paired"]) == []
