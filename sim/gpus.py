"""GPU figures the step-time model needs: memory, memory bandwidth and peak dense bf16/fp16 FLOP/s.

Figures are the vendors' datasheet values (dense, no sparsity). Bandwidths are what the roofline divides by;
the step-time model's fitted memory efficiency says how much of it vLLM's kernels actually get.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: usable memory (bytes), memory bandwidth (bytes/s), peak dense 16-bit FLOP/s."""

    name: str
    memory_bytes: float
    bandwidth_bps: float
    peak_flops: float

    def __post_init__(self) -> None:
        for field_name in ("memory_bytes", "bandwidth_bps", "peak_flops"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"GPU {self.name!r}: {field_name} must be a positive number, got {value!r}")


GPUS: dict[str, GpuSpec] = {
    # A100 SXM4 40 GB: HBM2, 1,555 GB/s, 312 TFLOP/s bf16 dense.
    "A100-40GB": GpuSpec("A100-40GB", 40 * GIB, 1.555e12, 312e12),
    # H100 SXM5 64 GB (four HBM stacks, e.g. MareNostrum 5, where the reference was measured). Its bandwidth is
    # less well documented than the 80 GB part's; 2.0 TB/s is assumed. The fitted memory efficiency absorbs the error.
    "H100-64GB": GpuSpec("H100-64GB", 64 * GIB, 2.0e12, 989e12),
    # H100 SXM5 80 GB: HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense.
    "H100-80GB": GpuSpec("H100-80GB", 80 * GIB, 3.35e12, 989e12),
    # H200 SXM 141 GB: HBM3e, 4.8 TB/s, same compute as the H100 SXM.
    "H200": GpuSpec("H200", 141e9, 4.8e12, 989e12),
    # L4 24 GB: GDDR6, 300 GB/s, 121 TFLOP/s bf16 dense.
    "L4": GpuSpec("L4", 24 * GIB, 300e9, 121e12),
}

ALIASES = {"A100": "A100-40GB", "H100": "H100-80GB", "H100-64": "H100-64GB", "H100-80": "H100-80GB",
           "H200-141GB": "H200"}

_SPEC_KEYS = {"name", "memory_gib", "bandwidth_gbps", "tflops"}


def get_gpu(name: str) -> GpuSpec:
    """The GPU called `name` (case-insensitive; `H100` means the 80 GB part)."""
    by_upper = {k.upper(): v for k, v in GPUS.items()}
    key = name.strip().upper()
    key = {k.upper(): v for k, v in ALIASES.items()}.get(key, key).upper()
    if key not in by_upper:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)} or give --gpu-spec")
    return by_upper[key]


def parse_gpu_spec(text: str) -> GpuSpec:
    """A GPU from `memory_gib=48,bandwidth_gbps=864,tflops=181[,name=L40S]` (bandwidth in GB/s, 10^9 bytes)."""
    values: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _SPEC_KEYS:
            raise ValueError(f"bad --gpu-spec part {part!r}: expected key=value with keys "
                             f"{', '.join(sorted(_SPEC_KEYS))}")
        values[key] = value.strip()
    missing = sorted(_SPEC_KEYS - {"name"} - set(values))
    if missing:
        raise ValueError(f"--gpu-spec {text!r} lacks {', '.join(missing)}")
    numbers: dict[str, float] = {}
    for key in ("memory_gib", "bandwidth_gbps", "tflops"):
        try:
            numbers[key] = float(values[key])
        except ValueError:
            raise ValueError(f"--gpu-spec {key}={values[key]!r} is not a number") from None
    return GpuSpec(values.get("name", "custom"), numbers["memory_gib"] * GIB, numbers["bandwidth_gbps"] * 1e9,
                   numbers["tflops"] * 1e12)
