"""`sim serve`'s configuration: a frozen value built from the command line, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from .gpus import GpuSpec
from .model import ModelSpec
from .steptime import StepCost


@dataclass(frozen=True)
class ServeConfig:
    """N simulated replicas of one model sharing one simulated GPU, on ports port..port+N-1."""

    model: ModelSpec
    gpu: GpuSpec
    replicas: int = 1
    port: int = 8000
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(max_model_len, 2048), vLLM V0's
    gpu_memory_utilization: float | None = None  # per replica; default 0.9 / replicas
    chunked_prefill: bool = False
    cost: StepCost = field(default_factory=StepCost)
    seed: int = 0
    log_level: str = "info"
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas must be a positive integer, got {self.replicas!r}")
        if not 0 <= self.port or self.port + self.replicas - 1 > 65535:
            raise ValueError(f"--port {self.port} with {self.replicas} replicas runs past port 65535")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be a positive integer, got {self.max_num_seqs!r}")
        util = self.utilization
        if not 0 < util <= 1 or util * self.replicas > 1.0 + 1e-9:
            raise ValueError(f"--gpu-memory-utilization {util:g} x {self.replicas} replicas must be in (0, 1]")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens!r}")

    @property
    def utilization(self) -> float:
        return self.gpu_memory_utilization if self.gpu_memory_utilization is not None else 0.9 / self.replicas

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    @property
    def batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(self.model.max_model_len, 2048) if not self.chunked_prefill else 8192
