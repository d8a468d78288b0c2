"""GPU sampling with NVML (pynvml) in a background thread: utilization, memory used, power, SM clock.

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
        return GpuSample(
            utilization_pct=float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            memory_used_bytes=self.memory_used_bytes(),
            power_w=None if power is None else power / 1000.0,
            sm_clock_mhz=self._optional(lambda: self._nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)))

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
        sm_clock_mean_mhz=_mean([s.sm_clock_mhz for s in samples if s.sm_clock_mhz is not None]))


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
