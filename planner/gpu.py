"""GPU sampling with NVML (pynvml) in a background thread: utilization, memory used, power, SM clock, and where
NVML's GPM metrics exist (Hopper and later GPUs, a recent driver) SM activity and occupancy.

When there is no NVIDIA GPU (`nvmlInit` fails; importing pynvml works everywhere) `open_sampler` returns None
and the profile simply has no GPU fields: nothing is faked. The NVML calls go through the `Nvml` protocol so
tests can drive the sampler with a fake.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import pynvml

from planner.points import GpuSummary

logger = logging.getLogger(__name__)


class Nvml(Protocol):
    """The part of pynvml the sampler uses."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int: ...


NVML_CLOCK_SM = 1  # pynvml.NVML_CLOCK_SM


@dataclass(frozen=True)
class GpuSample:
    """One reading."""

    utilization_pct: float
    memory_used_bytes: int
    power_w: float | None
    sm_clock_mhz: float | None
    sm_active_pct: float | None = None
    sm_occupancy_pct: float | None = None


class GpmActivity:
    """SM activity and occupancy between consecutive readings, from NVML's GPM metrics.

    `utilization.gpu` only says that *a* kernel ran during the period (one small kernel reads as 100%); GPM's
    SM_UTIL says what share of the SMs were busy, which is what replicas sharing a GPU compete for.
    """

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle
        self._previous: Any = None

    def read(self) -> tuple[float | None, float | None]:
        """(SM active %, SM occupancy %) since the last call; (None, None) on the first."""
        sample = self._nvml.nvmlGpmSampleAlloc()
        self._nvml.nvmlGpmSampleGet(self._handle, sample)
        previous, self._previous = self._previous, sample
        if previous is None:
            return None, None
        try:
            query = pynvml.c_nvmlGpmMetricsGet_t()
            query.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            query.numMetrics = 2
            query.sample1, query.sample2 = previous, sample
            query.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
            query.metrics[1].metricId = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
            self._nvml.nvmlGpmMetricsGet(query)
            values = [m.value if m.nvmlReturn == 0 else None for m in query.metrics[:2]]
        finally:
            self._nvml.nvmlGpmSampleFree(previous)
        return (None if values[0] is None else float(values[0]), None if values[1] is None else float(values[1]))


def open_gpm(nvml: Any, handle: Any) -> GpmActivity | None:
    """A GPM reader when this NVML and GPU offer GPM metrics, else None (older GPUs, old drivers, fakes)."""
    if not all(hasattr(nvml, f) for f in ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmMetricsGet")):
        return None
    try:
        support = nvml.nvmlGpmQueryDeviceSupport(handle)
        if not getattr(support, "isSupportedDevice", 0):
            return None
        reader = GpmActivity(nvml, handle)
        reader.read()
        return reader
    except (pynvml.NVMLError, AttributeError, OSError) as exc:
        logger.info("no SM activity: NVML GPM metrics are not available (%s)", exc)
        return None


class GpuSampler:
    """Samples one GPU every `interval_s` in a daemon thread between `start()` and `stop()`."""

    def __init__(self, nvml: Nvml, index: int = 0, interval_s: float = 0.2) -> None:
        self._nvml, self._interval = nvml, interval_s
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(self._handle)
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.memory_total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(self._handle).total)
        self._samples: list[GpuSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._before: int | None = None
        self._gpm = open_gpm(nvml, self._handle)

    def memory_used_bytes(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def mark_baseline(self) -> None:
        """Remember the memory used now (before the planner launches vLLM), to measure what vLLM adds."""
        self._before = self.memory_used_bytes()

    def _optional(self, read: Any) -> float | None:
        try:
            return float(read())
        except pynvml.NVMLError as exc:  # NotSupported & co.: some boards lack power or clock readings
            logger.debug("NVML reading not available: %s", exc)
            return None

    def sample(self) -> GpuSample:
        h = self._handle
        power = self._optional(lambda: self._nvml.nvmlDeviceGetPowerUsage(h))
        active, occupancy = self._sm_activity()
        return GpuSample(
            utilization_pct=float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            memory_used_bytes=self.memory_used_bytes(),
            power_w=None if power is None else power / 1000.0,
            sm_clock_mhz=self._optional(lambda: self._nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)),
            sm_active_pct=active, sm_occupancy_pct=occupancy)

    def _sm_activity(self) -> tuple[float | None, float | None]:
        if self._gpm is None:
            return None, None
        try:
            return self._gpm.read()
        except pynvml.NVMLError as exc:
            logger.info("SM activity stopped: %s", exc)
            self._gpm = None
            return None, None

    @property
    def has_sm_activity(self) -> bool:
        return self._gpm is not None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._samples.append(self.sample())
            self._stop.wait(self._interval)

    def start(self) -> None:
        self._samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> GpuSummary:
        """Stop sampling and summarize what was seen."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        return summarize_gpu(self.name, self.memory_total_bytes, self._samples, self._before)

    def __enter__(self) -> GpuSampler:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def summarize_gpu(name: str, total: int, samples: list[GpuSample], before: int | None) -> GpuSummary:
    """Means and maxima over the samples (pure)."""
    util = [s.utilization_pct for s in samples]
    return GpuSummary(
        name=name, memory_total_bytes=total, samples=len(samples), utilization_mean_pct=_mean(util),
        utilization_max_pct=max(util) if util else None,
        memory_used_max_bytes=max((s.memory_used_bytes for s in samples), default=None),
        memory_used_before_bytes=before,
        power_mean_w=_mean([s.power_w for s in samples if s.power_w is not None]),
        sm_clock_mean_mhz=_mean([s.sm_clock_mhz for s in samples if s.sm_clock_mhz is not None]),
        sm_active_mean_pct=_mean([s.sm_active_pct for s in samples if s.sm_active_pct is not None]),
        sm_occupancy_mean_pct=_mean([s.sm_occupancy_pct for s in samples if s.sm_occupancy_pct is not None]))


def open_sampler(index: int = 0, interval_s: float = 0.2, nvml: Nvml | None = None) -> GpuSampler | None:
    """A sampler for GPU `index`, or None when NVML cannot start (no NVIDIA GPU or driver)."""
    nvml = nvml or pynvml
    try:
        nvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as exc:  # no driver library, or no device
        logger.info("no GPU sampling: NVML did not start (%s)", exc)
        return None
    try:
        return GpuSampler(nvml, index, interval_s)
    except pynvml.NVMLError as exc:  # a bad index
        nvml.nvmlShutdown()
        logger.warning("no GPU sampling: GPU %d is not readable (%s)", index, exc)
        return None
