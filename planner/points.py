"""Values a profile is made of: one `ProfilePoint` per batch cap, and the `ProfileContext` they share.

Every field a source may lack is optional (None: not measured), never a made-up zero: the reference CSV has
mean TPOT but no p99 TPOT, a CPU run has no GPU samples, an `--url` run has no launch facts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from planner.errors import ProfileError


@dataclass(frozen=True)
class Latency:
    """One latency's summary over a point's requests, in milliseconds (None: not measured)."""

    mean: float | None = None
    p50: float | None = None
    p99: float | None = None


@dataclass(frozen=True)
class KvPool:
    """The replica's KV-cache pool as vLLM reports it (`vllm:cache_config_info`)."""

    num_blocks: int
    block_size: int
    bytes: int | None = None  # the pool's size in bytes, when vLLM says (kv_cache_memory_bytes) or we know

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> float | None:
        return self.bytes / self.tokens if self.bytes and self.tokens else None


@dataclass(frozen=True)
class GpuSummary:
    """What NVML saw while a point ran (absent entirely when there is no NVIDIA GPU)."""

    name: str
    memory_total_bytes: int
    samples: int
    utilization_mean_pct: float | None = None
    utilization_max_pct: float | None = None
    memory_used_max_bytes: int | None = None
    memory_used_before_bytes: int | None = None  # before the planner launched vLLM (None with --url)
    power_mean_w: float | None = None
    sm_clock_mean_mhz: float | None = None
    sm_active_mean_pct: float | None = None  # NVML GPM (Hopper and later): share of SMs busy
    sm_occupancy_mean_pct: float | None = None  # NVML GPM: active warps / the SMs' maximum


@dataclass(frozen=True)
class ProfilePoint:
    """One batch cap B, measured: throughput, latencies, and the replica's memory behaviour."""

    batch_size: int
    total_tok_s: float
    output_tok_s: float | None = None
    req_s: float | None = None
    ttft_ms: Latency = field(default_factory=Latency)
    tpot_ms: Latency = field(default_factory=Latency)
    itl_ms: Latency = field(default_factory=Latency)
    e2e_ms: Latency = field(default_factory=Latency)
    preemptions: int | None = None
    peak_kv_usage: float | None = None  # fraction of the KV pool, 0..1
    mean_running: float | None = None  # the engine's running requests over the run's /metrics scrapes
    metrics_missed: int | None = None  # /metrics scrapes that got no answer in time (a busy API server)
    kv_pool: KvPool | None = None
    gpu: GpuSummary | None = None
    num_requests: int | None = None
    failed_requests: int | None = None
    duration_s: float | None = None
    steady_tok_s: float | None = None  # tokens/s with all B in flight, the fill left out (planner.stats)
    steady_s: float | None = None
    client_cores: float | None = None  # the client's CPU over the run's wall time (one process can be the limit)

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ProfileError(f"batch size must be a positive integer, got {self.batch_size!r}")
        if not self.total_tok_s >= 0:
            raise ProfileError(f"B={self.batch_size}: total tokens/s must be >= 0, got {self.total_tok_s!r}")
        if self.peak_kv_usage is not None and not 0 <= self.peak_kv_usage <= 1:
            raise ProfileError(f"B={self.batch_size}: peak KV usage must be a fraction 0..1, "
                               f"got {self.peak_kv_usage!r}")

    def latency(self, name: str) -> float | None:
        """A latency by dotted name, e.g. 'tpot_ms.p99' (None: not measured)."""
        group, _, stat = name.partition(".")
        value: Latency = getattr(self, group)
        return getattr(value, stat)  # type: ignore[no-any-return]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfilePoint:
        """Rebuild a point from `to_dict` output, naming any unknown key."""
        _check_keys(cls, data, "profile point")
        data = dict(data)
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            data[name] = _build(Latency, data.get(name) or {}, name)
        if data.get("kv_pool") is not None:
            data["kv_pool"] = _build(KvPool, data["kv_pool"], "kv_pool")
        if data.get("gpu") is not None:
            data["gpu"] = _build(GpuSummary, data["gpu"], "gpu")
        return cls(**data)


@dataclass(frozen=True)
class Workload:
    """What the requests looked like: the lengths the memory plan needs."""

    kind: str = "fixed"  # fixed | sharegpt | jsonl | unknown
    input_tokens: int | None = None  # fixed: per request; others: the mean measured
    output_tokens: int | None = None
    source: str | None = None  # the dataset path, when there is one

    @property
    def tokens_per_request(self) -> int | None:
        if self.input_tokens is None or self.output_tokens is None:
            return None
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class ProfileContext:
    """Facts about the profiled replica that every point shares."""

    model: str | None = None
    device: str = "unknown"  # gpu | cpu | unknown
    workload: Workload = field(default_factory=Workload)
    vllm_args: tuple[str, ...] = ()  # extra vLLM arguments the planner launched it with
    weights_bytes: int | None = None
    kv_bytes_per_token: float | None = None
    cpu_kvcache_space_gib: float | None = None
    gpu_name: str | None = None
    gpu_memory_total_bytes: int | None = None
    source: str = ""  # where the profile was read from

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["vllm_args"] = list(self.vllm_args)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileContext:
        _check_keys(cls, data, "profile context")
        data = dict(data)
        data["workload"] = _build(Workload, data.get("workload") or {}, "workload")
        data["vllm_args"] = tuple(str(a) for a in data.get("vllm_args") or ())
        return cls(**data)


@dataclass(frozen=True)
class Profile:
    """A whole profile: the points (sorted by batch size, one per B) and their shared context."""

    points: tuple[ProfilePoint, ...]
    context: ProfileContext = field(default_factory=ProfileContext)

    def __post_init__(self) -> None:
        if not self.points:
            raise ProfileError(f"the profile {self.context.source!r} has no points")
        sizes = [p.batch_size for p in self.points]
        duplicates = sorted({b for b in sizes if sizes.count(b) > 1})
        if duplicates:
            raise ProfileError(f"the profile {self.context.source!r} has batch size(s) {duplicates} more than once")
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: p.batch_size)))

    def point(self, batch_size: int) -> ProfilePoint:
        for p in self.points:
            if p.batch_size == batch_size:
                return p
        raise KeyError(batch_size)


def _check_keys(cls: type, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ProfileError(f"{where} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise ProfileError(f"unknown key(s) in {where}: {', '.join(unknown)}")


def _build(cls: type, data: Any, where: str) -> Any:
    _check_keys(cls, data, where)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ProfileError(f"{where}: {exc}") from exc
