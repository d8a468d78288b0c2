"""A FAKE NVML (the part of pynvml the planner's GPU sampler calls), for tests on machines without a GPU."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pynvml

GIB = 2**30


@dataclass(frozen=True)
class _Memory:
    total: int
    used: int


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int = 0


class FakeNvml:
    """One fake 80 GiB GPU: utilization cycles through `utilization`, 10 GiB used, 300 W, no SM clock reading."""

    def __init__(self, utilization: tuple[int, ...] = (50,), used_bytes: int = 10 * GIB,
                 fail_init: bool = False) -> None:
        self._utilization = itertools.cycle(utilization)
        self.used_bytes = used_bytes
        self.fail_init = fail_init
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise pynvml.NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if index != 0:
            raise pynvml.NVMLError_InvalidArgument()
        return "handle-0"

    def nvmlDeviceGetName(self, handle: Any) -> Any:
        return b"Fake H100"

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return _Memory(total=80 * GIB, used=self.used_bytes)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return _Utilization(gpu=next(self._utilization))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return 300_000  # milliwatts

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        raise pynvml.NVMLError_NotSupported()


@dataclass(frozen=True)
class _GpmSupport:
    isSupportedDevice: int


class FakeNvmlWithGpm(FakeNvml):
    """A fake Hopper: GPM metrics say `sm_active` % of SMs busy at `occupancy` % warp occupancy; samples counted."""

    def __init__(self, sm_active: float = 62.5, occupancy: float = 31.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sm_active, self.occupancy = sm_active, occupancy
        self.allocated = self.freed = 0

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        return _GpmSupport(isSupportedDevice=1)

    def nvmlGpmSampleAlloc(self) -> Any:
        self.allocated += 1
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> None:
        return None

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.freed += 1

    def nvmlGpmMetricsGet(self, query: Any) -> Any:
        values = {pynvml.NVML_GPM_METRIC_SM_UTIL: self.sm_active, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: self.occupancy}
        for i in range(query.numMetrics):
            query.metrics[i].value = values[query.metrics[i].metricId]
            query.metrics[i].nvmlReturn = 0
        return query
