"""One simulated GPU and the vLLM replicas that share it."""

from __future__ import annotations

from dataclasses import dataclass

from .clock import Clock
from .device import SharedDevice
from .engine import Engine, EngineConfig
from .gpus import GpuSpec
from .memory import num_gpu_blocks
from .model import ModelSpec
from .steptime import StepCost, StepTimeModel


@dataclass(frozen=True)
class NodeSpec:
    """N replicas of one model on one GPU, each with the same vLLM settings."""

    model: ModelSpec
    gpu: GpuSpec
    replicas: int = 1
    max_num_seqs: int = 256
    utilization: float | None = None  # per replica; default 0.9 / replicas
    max_num_batched_tokens: int | None = None  # default: vLLM V0's max(max_model_len, 2048); 8192 chunked
    chunked_prefill: bool = False
    cost: StepCost = StepCost()
    prefix_caching: bool = False  # vLLM's automatic prefix caching (requests need block hashes to use it)

    def engine_config(self) -> EngineConfig:
        util = self.utilization if self.utilization is not None else 0.9 / self.replicas
        default_tokens = 8192 if self.chunked_prefill else max(self.model.max_model_len, 2048)
        return EngineConfig(num_gpu_blocks=num_gpu_blocks(self.model, self.gpu, util, self.max_num_seqs),
                            max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens or default_tokens,
                            max_model_len=self.model.max_model_len, chunked_prefill=self.chunked_prefill,
                            enable_prefix_caching=self.prefix_caching)


class Node:
    """The shared device and the engines, running on one clock."""

    def __init__(self, spec: NodeSpec, clock: Clock) -> None:
        self.spec = spec
        self.clock = clock
        self.device = SharedDevice(clock)
        self.steptime = StepTimeModel(spec.model, spec.gpu, spec.cost)
        self.engine_config = spec.engine_config()
        self.engines = [Engine(self.engine_config, self.steptime, self.device, clock, f"replica-{i}")
                        for i in range(spec.replicas)]
