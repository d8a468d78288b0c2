"""One simulated GPU and the vLLM replicas that share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .clock import Clock
from .device import SharedDevice
from .engine import Engine, EngineConfig
from .gpus import GpuSpec
from .memory import num_gpu_blocks
from .model import ModelSpec
from .measured import MeasuredStepTime, ReplicaModel
from .steptime import StepCost, StepTime, StepTimeModel

if TYPE_CHECKING:
    from gateway.speed import Speed


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

    def build(self, clock: Clock) -> tuple[SharedDevice, StepTime, list[Engine]]:
        """The shared GPU, the step-time model and the engines on it."""
        device, steptime, config = SharedDevice(clock), StepTimeModel(self.model, self.gpu, self.cost), \
            self.engine_config()
        return device, steptime, [Engine(config, steptime, device, clock, f"replica-{i}") for i in range(self.replicas)]

    def gateway_speed(self) -> Speed:
        """What a profile of one replica alone would tell the gateway (see `sim.fleet.speed_of`)."""
        from .fleet import speed_of

        return speed_of(self)


@dataclass(frozen=True)
class MeasuredSpec:
    """N replicas imitating a profiled real one (`sim calibrate --profile`), each on its own device unless the
    model says they share one GPU."""

    replica: ReplicaModel
    replicas: int = 1

    @property
    def max_num_seqs(self) -> int:
        return self.replica.max_num_seqs

    @property
    def prefix_caching(self) -> bool:
        return self.replica.prefix_caching

    def engine_config(self) -> EngineConfig:
        r = self.replica
        return EngineConfig(num_gpu_blocks=r.num_blocks, max_num_seqs=r.max_num_seqs,
                            max_num_batched_tokens=r.max_num_batched_tokens, max_model_len=r.max_model_len,
                            block_size=r.block_size, chunked_prefill=r.chunked_prefill,
                            enable_prefix_caching=r.prefix_caching)

    def build(self, clock: Clock) -> tuple[SharedDevice, StepTime, list[Engine]]:
        shared, config = SharedDevice(clock), self.engine_config()
        engines = [Engine(config, MeasuredStepTime(self.replica),  # its own: each replica's speed can be scaled
                          shared if self.replica.shared_device else SharedDevice(clock), clock, f"replica-{i}",
                          host_on_device=self.replica.frontend_on_core)
                   for i in range(self.replicas)]
        return shared, engines[0].steptime, engines

    def gateway_speed(self) -> Speed:
        """The measured step times and prefill rate, as `planner plan` would give them to the gateway."""
        from gateway.speed import Speed

        return Speed(self.replica.step_s, self.replica.prefill_tokens_s)


AnySpec = Union[NodeSpec, MeasuredSpec]


class Node:
    """The shared device and the engines, running on one clock."""

    def __init__(self, spec: AnySpec, clock: Clock) -> None:
        self.spec = spec
        self.clock = clock
        self.device, self.steptime, self.engines = spec.build(clock)
        self.engine_config = spec.engine_config()
