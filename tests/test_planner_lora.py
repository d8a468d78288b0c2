"""The planner counts LoRA adapter slots in each replica's memory and passes the LoRA settings into the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.plan import load
from planner import modelinfo
from planner.cli import main
from planner.errors import PlannerError
from planner.planning import PlanConfig
from tests.test_planner_plan_cli import GPU_FLAGS, REFERENCE


def test_one_slot_is_rank_times_every_linear_layer_in_and_out() -> None:
    """OPT-1.3B at rank 16: 16 x (q, k, v, o: 4 x (2048 + 2048) + fc1, fc2: 2 x (2048 + 8192)) x 24 layers x 2 B;
    Llama-3.2-1B's grouped KV and gated MLP: q, o 2 x 4096 + k, v 2 x (2048 + 512) + 3 x (2048 + 8192)."""
    assert modelinfo.lora_slot_bytes("synthetic:opt-1.3b", 16)[0] == 16 * (4 * 4096 + 2 * 10240) * 24 * 2  # type: ignore[index]
    llama = modelinfo.lora_slot_bytes("synthetic:llama-3.2-1b", 8)
    assert llama is not None and llama[0] == 8 * (2 * 4096 + 2 * 2560 + 3 * 10240) * 16 * 2
    assert modelinfo.lora_slot_bytes("no/such-model", 16) is None


def test_plan_counts_the_slots_and_sets_the_flags(tmp_path: Path) -> None:
    """--max-loras 4 --max-lora-rank 16: each slice grows by 4 slots; every replica gets the LoRA settings."""
    plain, lora = tmp_path / "plain.yaml", tmp_path / "lora.yaml"
    flags = ["plan", "--profile", str(REFERENCE), "--tokens-per-request", "400", *GPU_FLAGS[:-2],
             "--model", "synthetic:opt-1.3b"]
    assert main([*flags, "--out", str(plain)]) == 0
    assert main([*flags, "--out", str(lora), "--max-loras", "4", "--max-lora-rank", "16"]) == 0
    without, with_ = load(plain), load(lora)
    memory = with_.reasoning["memory"]
    assert memory["lora_bytes"] == 4 * 16 * (4 * 4096 + 2 * 10240) * 24 * 2
    assert memory["total_bytes"] - without.reasoning["memory"]["total_bytes"] == pytest.approx(
        memory["lora_bytes"] * 1.1, abs=2)
    assert memory["sources"]["lora"].startswith("4 slots x (computed: rank 16")
    assert {(r.max_loras, r.max_lora_rank) for r in with_.replicas} == {(4, 16)}
    assert {(r.max_loras, r.max_lora_rank) for r in without.replicas} == {(None, None)}


def test_bad_lora_settings_are_named() -> None:
    with pytest.raises(PlannerError, match="--max-lora-rank"):
        PlanConfig(max_loras=2, max_lora_rank=12)
    with pytest.raises(PlannerError, match="--max-loras"):
        PlanConfig(max_loras=0)
