"""LoRA adapters for the tiny model, made locally (no `peft` needed): PEFT's file format, written directly.

Each adapter is a directory vLLM's `/v1/load_lora_adapter` accepts: `adapter_config.json` (PEFT's keys) and
`adapter_model.safetensors` with `base_model.model.<module>.lora_{A,B}.weight` tensors on the MLP (`fc1`, `fc2`)
of every decoder layer. The weights are random and large on purpose, drawn from a seed per adapter, so that the
greedy output of the tiny model differs from one adapter to the next and from the base model: a test can tell
which adapter answered.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from deploy.tinymodel import FFN, HIDDEN, LAYERS, make_atomically

RANK = 8
ALPHA = 16
SCALE = 0.5  # the std of the random factors: large enough to change the tiny model's greedy tokens
TARGETS = ("fc1", "fc2")


def is_complete(path: Path) -> bool:
    """Whether `path` holds a whole adapter."""
    return (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()


def ensure_tiny_adapter(path: str | Path, name: str, base_model: str, rank: int = RANK) -> Path:
    """Return a directory holding the adapter `name` for the tiny model, making it first if it is not there."""
    seed = zlib.crc32(name.encode())
    return make_atomically(Path(path), lambda scratch: _make(scratch, seed, base_model, rank), is_complete,
                           f"the tiny LoRA adapter {name!r}")


def _make(path: Path, seed: int, base_model: str, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    shapes = {"fc1": (HIDDEN, FFN), "fc2": (FFN, HIDDEN)}  # (in, out)
    tensors = {}
    for layer in range(LAYERS):
        for target in TARGETS:
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.decoder.layers.{layer}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * SCALE
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * SCALE
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": ALPHA,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
              "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
