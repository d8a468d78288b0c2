"""Memory per replica and how many replicas fit: pure functions over frozen values.

A replica's slice of the device is

    weights + KV for B* requests + runtime overhead (+ LoRA adapter slots), plus a safety margin on the sum

where the KV part is the measured peak KV usage at B* (fraction of the pool x pool size) when the profile has
it, else B* x (tokens per request rounded up to whole KV blocks) x bytes per token (the larger of the two when
both are known: see `replica_memory`). On a GPU the slices are
packed into the usable part of the device (vLLM's default 0.9 of it) and the usable memory is then shared out
evenly, as the papers do (0.9 / N each): the leftover, less than one slice, becomes headroom for every replica.
On the CPU build vLLM takes the KV pool in whole GiB (VLLM_CPU_KVCACHE_SPACE), so the KV part is rounded up.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from planner.errors import MemoryPlanError
from planner.points import KvPool

GIB = 1024**3


def gib(n_bytes: float) -> float:
    """Bytes as GiB, rounded for people."""
    return round(n_bytes / GIB, 3)


def kv_bytes_for_batch(batch_size: int, tokens_per_request: int, bytes_per_token: float, block_size: int) -> int:
    """KV bytes that `batch_size` requests of `tokens_per_request` tokens hold, in whole blocks per request."""
    if min(batch_size, tokens_per_request, block_size) < 1 or not bytes_per_token > 0:
        raise MemoryPlanError(f"KV sizing needs positive values, got B={batch_size}, tokens/request="
                              f"{tokens_per_request}, bytes/token={bytes_per_token}, block size={block_size}")
    blocks = math.ceil(tokens_per_request / block_size)
    return math.ceil(batch_size * blocks * block_size * bytes_per_token)


def measured_kv_bytes(peak_usage: float, pool: KvPool, bytes_per_token: float | None) -> int | None:
    """Bytes of KV the replica held at its peak: the used fraction of the pool, in whole blocks (None: unknown)."""
    per_token = bytes_per_token or pool.bytes_per_token
    if per_token is None:
        return None
    blocks = math.ceil(peak_usage * pool.num_blocks - 1e-9)
    return math.ceil(blocks * pool.block_size * per_token)


@dataclass(frozen=True)
class MemoryFacts:
    """What a replica's slice is made of (bytes), and where the KV figure may come from."""

    weights_bytes: int
    overhead_bytes: int
    margin: float = 0.10
    kv_bytes_per_token: float | None = None
    tokens_per_request: int | None = None
    block_size: int = 16
    measured_kv_bytes: int | None = None  # peak KV usage at B*, from the profile
    lora_bytes: int = 0  # LoRA adapter slots: max_loras x one slot at max_lora_rank (0: LoRA off)

    def __post_init__(self) -> None:
        if self.lora_bytes < 0:
            raise MemoryPlanError(f"LoRA memory must be >= 0 bytes, got {self.lora_bytes}")
        if self.weights_bytes < 0 or self.overhead_bytes < 0:
            raise MemoryPlanError(f"weights and overhead must be >= 0 bytes, got {self.weights_bytes}, "
                                  f"{self.overhead_bytes}")
        if not 0 <= self.margin < 1:
            raise MemoryPlanError(f"memory margin must be a fraction in [0, 1), got {self.margin!r}")


@dataclass(frozen=True)
class ReplicaMemory:
    """One replica's slice, part by part (bytes)."""

    batch_size: int
    weights_bytes: int
    kv_bytes: int
    kv_source: str
    overhead_bytes: int
    margin_bytes: int
    lora_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes + self.lora_bytes + self.margin_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_bytes"] = self.total_bytes
        data["gib"] = {k.removesuffix("_bytes"): gib(v) for k, v in data.items() if k.endswith("_bytes")}
        return data


def replica_memory(facts: MemoryFacts, batch_size: int) -> ReplicaMemory:
    """The slice one replica capped at `batch_size` needs.

    KV: the measured peak when the profile has one; when the workload's lengths are known too, the larger of
    the two, because the peak is sampled (a short run can fall between scrapes) and requests in a steady closed
    loop are staggered, while a burst can bring B* requests to full length at once.
    """
    computed = None
    if facts.kv_bytes_per_token is not None and facts.tokens_per_request is not None:
        computed = kv_bytes_for_batch(batch_size, facts.tokens_per_request, facts.kv_bytes_per_token,
                                      facts.block_size)
        how = (f"{batch_size} requests x {facts.tokens_per_request} tokens rounded up to {facts.block_size}-token "
               f"blocks x {facts.kv_bytes_per_token:g} bytes/token")
    measured = facts.measured_kv_bytes
    if measured is not None and (computed is None or measured >= computed):
        kv, source = measured, f"measured: peak KV-cache usage at B={batch_size} x the KV pool"
        if computed is not None:
            source += f" (>= {computed} bytes computed: {how})"
    elif computed is not None:
        kv, source = computed, f"computed: {how}"
        if measured is not None:
            source += f" (> the {measured} bytes measured at the sampled peak)"
    else:
        missing = [flag for flag, value in (("--kv-bytes-per-token", facts.kv_bytes_per_token),
                                            ("--tokens-per-request", facts.tokens_per_request)) if value is None]
        raise MemoryPlanError("the profile has no measured KV usage, so the KV need is computed, and that needs "
                              f"{' and '.join(missing)}")
    margin = math.ceil(facts.margin * (facts.weights_bytes + kv + facts.overhead_bytes + facts.lora_bytes))
    return ReplicaMemory(batch_size, facts.weights_bytes, kv, source, facts.overhead_bytes, margin, facts.lora_bytes)


@dataclass(frozen=True)
class GpuLayout:
    """How many slices share the device, and each replica's `gpu_memory_utilization`."""

    replicas: int
    fit: int  # how many slices fit in the usable memory
    device_bytes: int
    usable_fraction: float
    needed_fraction: float  # one slice / the device
    fraction_each: float  # what each replica is given: usable / replicas, rounded down

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_layout(replica: ReplicaMemory, device_bytes: int, usable_fraction: float = 0.9,
               replicas: int | None = None, max_replicas: int | None = None) -> GpuLayout:
    """Pack slices into `usable_fraction` of the device; `replicas` asks for an exact count (must fit)."""
    if device_bytes <= 0:
        raise MemoryPlanError(f"GPU memory must be positive, got {device_bytes} bytes")
    if not 0 < usable_fraction <= 1:
        raise MemoryPlanError(f"usable fraction must be in (0, 1], got {usable_fraction!r}")
    usable = usable_fraction * device_bytes
    fit = int(usable // replica.total_bytes)
    if fit < 1:
        raise MemoryPlanError(f"one replica needs {gib(replica.total_bytes)} GiB at B={replica.batch_size} but "
                              f"only {gib(usable)} GiB of the {gib(device_bytes)} GiB device is usable; choose a "
                              "smaller batch (a latency SLO or larger --epsilon) or a bigger device")
    if replicas is not None and replicas > fit:
        raise MemoryPlanError(f"{replicas} replicas were asked for but only {fit} fit "
                              f"({gib(replica.total_bytes)} GiB each in {gib(usable)} GiB usable)")
    count = replicas if replicas is not None else min(fit, max_replicas or fit)
    if count < 1:
        raise MemoryPlanError(f"the replica count must be at least 1, got {count}")
    each = math.floor(usable_fraction / count * 10_000) / 10_000
    return GpuLayout(replicas=count, fit=fit, device_bytes=device_bytes, usable_fraction=usable_fraction,
                     needed_fraction=round(replica.total_bytes / device_bytes, 4), fraction_each=each)


def cpu_kvcache_space_gib(kv_bytes: int, margin: float) -> int:
    """VLLM_CPU_KVCACHE_SPACE for one replica: its KV need plus the margin, in whole GiB (at least 1)."""
    return max(1, math.ceil(kv_bytes * (1 + margin) / GIB))
