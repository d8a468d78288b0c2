"""Where a profile point's replica comes from: one the planner launches per batch cap, or one already running.

Launching goes through `deploy.process.VllmServer` (its own process group, a readiness wait that fails fast
when vLLM dies, the whole group killed on exit), with `--max-num-seqs B` for each point.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from deploy.plan import ReplicaSpec
from deploy.process import VllmServer, vllm_argv

logger = logging.getLogger(__name__)


class ServerProvider(Protocol):
    """Gives the base URL of a replica capped at `batch_size` for the duration of a `with` block."""

    @property
    def launches(self) -> bool:
        """Whether each point gets a fresh replica (so GPU memory before launch is a baseline)."""

    def serve(self, batch_size: int) -> contextlib.AbstractContextManager[str]: ...

    def describe(self, batch_size: int) -> str: ...


@dataclass(frozen=True)
class RunningServer:
    """An already running replica: its batch cap is whatever it was started with; B is only the concurrency."""

    url: str
    launches: bool = False

    @contextlib.contextmanager
    def serve(self, batch_size: int) -> Iterator[str]:
        yield self.url.rstrip("/")

    def describe(self, batch_size: int) -> str:
        return f"use the running server {self.url} (its own --max-num-seqs)"


@dataclass(frozen=True)
class LaunchedServer:
    """A vLLM server launched for each point with `--max-num-seqs B` (and the user's extra arguments)."""

    model: str
    port: int
    log_dir: Path
    vllm_args: tuple[str, ...] = ()
    cpu_kvcache_space_gib: float | None = None
    env: Mapping[str, str] | None = None
    startup_timeout_s: float = 900.0
    served_model_name: str | None = None
    launches: bool = field(default=True, init=False)

    def spec(self, batch_size: int) -> ReplicaSpec:
        return ReplicaSpec(name=f"profile-b{batch_size}", model=self.model, port=self.port, max_num_seqs=batch_size,
                           cpu_kvcache_space_gib=self.cpu_kvcache_space_gib, extra_args=self.vllm_args,
                           served_model_name=self.served_model_name)

    @contextlib.contextmanager
    def serve(self, batch_size: int) -> Iterator[str]:
        log = self.log_dir / f"vllm-b{batch_size:05d}.log"
        with VllmServer(self.spec(batch_size), log, self.env, startup_timeout_s=self.startup_timeout_s) as server:
            yield server.url

    def describe(self, batch_size: int) -> str:
        env = f"VLLM_CPU_KVCACHE_SPACE={self.cpu_kvcache_space_gib:g} " if self.cpu_kvcache_space_gib else ""
        return f"launch {env}{shlex.join(vllm_argv(self.spec(batch_size)))}"
