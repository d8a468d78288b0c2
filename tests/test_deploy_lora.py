"""LoRA in deploy: the plan's settings reach vLLM's command line and environment, and the gateway's registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deploy.cli import _parser, build_plan
from deploy.hardware import Hardware
from deploy.launch import gateway_config
from deploy.plan import Plan, PlanError, ReplicaSpec, dump, load
from deploy.process import vllm_argv, vllm_env
from deploy.tinylora import ensure_tiny_adapter, is_complete
from gateway.config import from_mapping

CPU = Hardware(gpus=(), cpus=(0, 1))


def test_lora_flags_and_environment() -> None:
    """max_loras turns LoRA on: --enable-lora, --max-loras, --max-lora-rank and runtime loading allowed."""
    spec = ReplicaSpec("r0", "m", 8001, max_loras=2, max_lora_rank=8)
    argv = vllm_argv(spec)
    assert argv[argv.index("--enable-lora"):argv.index("--enable-lora") + 5] == \
        ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    assert vllm_env(spec, {})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = ReplicaSpec("r0", "m", 8001)
    assert "--enable-lora" not in vllm_argv(plain) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(plain, {})


def test_bad_lora_settings_are_refused() -> None:
    """A rank vLLM refuses, a rank without LoRA, adapters with no replica serving LoRA: named errors."""
    with pytest.raises(PlanError, match="max_lora_rank"):
        ReplicaSpec("r0", "m", 8001, max_loras=1, max_lora_rank=12)
    with pytest.raises(PlanError, match="no max_loras"):
        ReplicaSpec("r0", "m", 8001, max_lora_rank=8)
    with pytest.raises(PlanError, match="adapters"):
        Plan(model="m", replicas=(ReplicaSpec("r0", "m", 8001),), adapters={"a": "/p"})


def test_flags_make_the_plan_and_the_gateway_registry(tmp_path: Path) -> None:
    """`deploy up --max-loras 2 --lora a=/p`: every replica serves LoRA; the gateway config registers `a`."""
    args = _parser().parse_args(["up", "--model", "m", "--max-loras", "2", "--max-lora-rank", "8",
                                 "--lora", "a=/p/a", "--lora", "b=org/b"])
    plan = build_plan(args, CPU)
    assert {(r.max_loras, r.max_lora_rank) for r in plan.replicas} == {(2, 8)}
    config = from_mapping(yaml.safe_load(yaml.safe_dump(gateway_config(plan))))
    assert config.lora.max_loras == 2 and {a.name: a.path for a in config.lora.adapters} == {"a": "/p/a", "b": "org/b"}
    dump(plan, tmp_path / "plan.yaml")
    assert load(tmp_path / "plan.yaml") == plan
    assert not from_mapping(gateway_config(build_plan(_parser().parse_args(["up"]), CPU))).lora.enabled
    with pytest.raises(ValueError, match="NAME=PATH"):
        build_plan(_parser().parse_args(["up", "--lora", "nopath"]), CPU)


def test_tiny_adapters_are_distinct_peft_directories(tmp_path: Path) -> None:
    """Each tiny adapter is a PEFT directory with its own weights (a seed per name)."""
    from safetensors.torch import load_file

    a = ensure_tiny_adapter(tmp_path / "a", "a", "/m")
    b = ensure_tiny_adapter(tmp_path / "b", "b", "/m")
    assert is_complete(a) and json.loads((a / "adapter_config.json").read_text())["r"] == 8
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and any(not wa[k].equal(wb[k]) for k in wa)
