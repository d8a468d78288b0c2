"""What the replicas run on: an NVIDIA GPU (found with pynvml) or this machine's CPU cores."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU."""

    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class Hardware:
    """The GPUs found (empty: CPU mode) and the CPU cores this process may use."""

    gpus: tuple[Gpu, ...]
    cpus: tuple[int, ...]

    @property
    def device(self) -> str:
        return "gpu" if self.gpus else "cpu"

    @property
    def starts_one_at_a_time(self) -> bool:
        """Whether replicas must start one after another, each healthy before the next: on a GPU, where vLLM sizes
        a replica's memory from what is free when it starts. On CPU their memory is set (`VLLM_CPU_KVCACHE_SPACE`)
        and each has its own cores, so they start at once (two tiny-model replicas behind the gateway: ready in
        34-36 s instead of 66-68 on 2 cores)."""
        return bool(self.gpus)


def detect_gpus() -> tuple[Gpu, ...]:
    """The NVIDIA GPUs pynvml sees; none when there is no driver or no library."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.debug("no NVIDIA GPU: %s", exc)
        return ()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(Gpu(i, name.decode() if isinstance(name, bytes) else str(name), int(memory)))
        return tuple(gpus)
    finally:
        pynvml.nvmlShutdown()


def usable_cpus() -> tuple[int, ...]:
    """The CPU ids this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def detect(device: str = "auto") -> Hardware:
    """GPUs and CPUs; `device` "cpu" ignores any GPU, "gpu" insists on one."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, got {device!r}")
    gpus = () if device == "cpu" else detect_gpus()
    if device == "gpu" and not gpus:
        raise ValueError("--device gpu: no NVIDIA GPU found (pynvml sees none)")
    return Hardware(gpus=gpus, cpus=usable_cpus())


def split_cpus(cpus: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """Split CPU ids into `parts` contiguous, disjoint slices as even as possible.

    With fewer CPUs than parts, slices are shared round-robin: each replica still gets one core to itself
    for its OpenMP threads, but two replicas land on the same core.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts!r}")
    if not cpus:
        raise ValueError("no CPUs to split")
    if len(cpus) < parts:
        return [(cpus[i % len(cpus)],) for i in range(parts)]
    size, extra = divmod(len(cpus), parts)
    slices, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        slices.append(tuple(cpus[start:end]))
        start = end
    return slices


def cpu_list(cpus: tuple[int, ...]) -> str:
    """CPU ids in vLLM's VLLM_CPU_OMP_THREADS_BIND form, ranges collapsed: (0, 1, 2, 5) -> "0-2,5"."""
    ranges: list[str] = []
    start = prev = None
    for cpu in sorted(cpus):
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            ranges.append(f"{start}-{prev}" if start != prev else str(start))
        start = prev = cpu
    if start is not None:
        ranges.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(ranges)
