"""Wiring: frozen command configs (built by cli.py) -> the components that do the work."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp

from deploy.ports import free_ports
from planner import modelinfo
from synthetic import catalog
from planner.client import served_model
from planner.errors import PlannerError, RunError
from planner.gpu import GpuSampler, open_sampler
from planner.points import ProfileContext
from planner.profiler import ProfileConfig, Profiler
from planner.servers import LaunchedServer, RunningServer, ServerProvider
from planner.workload import FixedLengths, WorkloadSource, load_jsonl, load_sharegpt, prompt_builder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkloadOptions:
    """Which requests to send."""

    input_tokens: int = 512
    output_tokens: int = 256
    dataset: str | None = None
    dataset_format: str | None = None  # sharegpt | jsonl | None (by extension)
    tokenizer: str | None = None
    ignore_eos: bool = True


def build_workload(options: WorkloadOptions, model: str | None) -> WorkloadSource:
    """Fixed lengths, or the dataset named, with prompts built by the best tokenizer at hand."""
    builder = prompt_builder(model, options.tokenizer)
    if options.dataset is None:
        return FixedLengths(options.input_tokens, options.output_tokens, builder, options.ignore_eos)
    kind = options.dataset_format or ("jsonl" if options.dataset.endswith(".jsonl") else "sharegpt")
    loader = load_jsonl if kind == "jsonl" else load_sharegpt
    return loader(options.dataset, builder, options.output_tokens, options.ignore_eos)


@dataclass(frozen=True)
class ProfileCommand:
    """Everything `planner profile` was asked to do."""

    sweep: ProfileConfig
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    model: str | None = None
    url: str | None = None
    vllm_args: tuple[str, ...] = ()
    port: int = 0
    cpu_kvcache_space_gib: float | None = None
    startup_timeout_s: float = 900.0
    device: str = "auto"
    gpu_index: int = 0

    def __post_init__(self) -> None:
        if (self.model is None) == (self.url is None):
            raise PlannerError("give exactly one of --model (launch vLLM) and --url (a running server)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise PlannerError(f"--url {self.url!r} is not an http(s) URL")


@dataclass(frozen=True)
class LaunchModel:
    """What vLLM is launched with for `--model`: the model itself, or a synthetic model's directory and flags."""

    source: str
    served_name: str | None = None
    vllm_args: tuple[str, ...] = ()


def launch_model(model: str, vllm_args: tuple[str, ...], gpu: bool) -> LaunchModel:
    """`synthetic:NAME` becomes its local directory, its served name and the flags it needs on this device."""
    if not catalog.is_synthetic(model):
        return LaunchModel(model, None, vllm_args)
    from deploy.launch import flag_names, missing_flags
    from deploy.models import ModelError, synthetic

    try:
        resolved = synthetic(model)
    except ModelError as exc:
        raise PlannerError(str(exc)) from None
    args = (*vllm_args, *missing_flags(resolved.vllm_flags(gpu), vllm_args))
    if resolved.default_max_model_len and "--max-model-len" not in flag_names(args):
        args = (*args, "--max-model-len", str(resolved.default_max_model_len))
    return LaunchModel(resolved.source, resolved.served_name, args)


def _servers(cmd: ProfileCommand, launch: LaunchModel | None) -> ServerProvider:
    if cmd.url is not None or launch is None:
        return RunningServer(cmd.url or "")
    return LaunchedServer(model=launch.source, port=cmd.port or free_ports(), log_dir=cmd.sweep.out / "logs",
                          vllm_args=launch.vllm_args, cpu_kvcache_space_gib=cmd.cpu_kvcache_space_gib,
                          startup_timeout_s=cmd.startup_timeout_s, served_model_name=launch.served_name)


def _gpu(cmd: ProfileCommand) -> GpuSampler | None:
    if cmd.sweep.dry_run or cmd.device == "cpu":
        return None
    sampler = open_sampler(cmd.gpu_index)
    if sampler is None and cmd.device == "gpu":
        logger.warning("--device gpu but NVML found no GPU: the profile will have no GPU samples")
    return sampler


async def _ask_model(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        return await served_model(session, url.rstrip("/"))


def _model_name(cmd: ProfileCommand) -> str | None:
    if cmd.sweep.model_name or cmd.model:
        return cmd.sweep.model_name or cmd.model
    if cmd.sweep.dry_run:
        return None
    assert cmd.url is not None
    try:
        return asyncio.run(_ask_model(cmd.url))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise RunError(f"cannot read the model from {cmd.url}/v1/models: {exc}") from exc


def _kv_space(cmd: ProfileCommand) -> float | None:
    if cmd.cpu_kvcache_space_gib is not None:
        return cmd.cpu_kvcache_space_gib
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    return float(value) if value and value.isdigit() else None


def build_profiler(cmd: ProfileCommand, out: Callable[[str], None] = print) -> Profiler:
    """The profiler for a command: its replica source, workload, GPU sampler and shared context."""
    model = _model_name(cmd)
    gpu = _gpu(cmd)
    device = cmd.device if cmd.device != "auto" else ("gpu" if gpu is not None else "cpu")
    launch = launch_model(cmd.model, cmd.vllm_args, device == "gpu") if cmd.model else None
    local = cmd.model or model  # a local path (or a shipped config) lets us read weights, config and tokenizer
    workload = build_workload(cmd.workload, launch.source if launch else local)
    context = ProfileContext(
        model=model, device=device, workload=workload.describe(), vllm_args=cmd.vllm_args,
        weights_bytes=modelinfo.weights_bytes(local) if local else None,
        kv_bytes_per_token=modelinfo.kv_bytes_per_token(local) if local else None,
        cpu_kvcache_space_gib=_kv_space(cmd) if device == "cpu" else None,
        gpu_name=gpu.name if gpu else None, gpu_memory_total_bytes=gpu.memory_total_bytes if gpu else None,
        source=str(cmd.sweep.out))
    sweep = replace(cmd.sweep, model_name=cmd.sweep.model_name or (launch and launch.served_name) or model)
    return Profiler(sweep, _servers(cmd, launch), workload, context, gpu, out)
