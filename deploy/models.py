"""Which model a replica loads: a local path, a Hugging Face id, `synthetic:NAME` (a real architecture with random
weights, made locally), or the tiny offline model when the hub is out of reach."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deploy.tinyembed import TINY_EMBED_NAME, ensure_tiny_embedding_model
from deploy.tinymodel import TINY_MODEL_NAME, ensure_tiny_model
from synthetic import catalog

logger = logging.getLogger(__name__)

TINY_ALIASES = ("tiny", TINY_MODEL_NAME)


class ModelError(ValueError):
    """The model named cannot be used (a missing local path, an unknown hub id); the message names it."""


@dataclass(frozen=True)
class ResolvedModel:
    """What to pass to vLLM for a model the user named, and how we got there."""

    requested: str
    source: str  # vLLM's --model: a local directory or a hub id
    served_name: str | None  # vLLM's --served-model-name (None: vLLM's default, the source)
    offline: bool = False  # the hub is out of reach: replicas run with HF_HUB_OFFLINE=1
    fallback_reason: str | None = None  # set when the tiny model stands in for `requested`
    flags: tuple[tuple[str, ...], ...] = ()  # vLLM flag groups this model needs (unless the user gave the flag)
    cpu_flags: tuple[tuple[str, ...], ...] = ()  # more of them on the CPU build
    default_max_model_len: int | None = None  # --max-model-len when the plan names none

    def vllm_flags(self, gpu: bool) -> tuple[tuple[str, ...], ...]:
        """The flag groups to add on this device."""
        return self.flags if gpu else (*self.flags, *self.cpu_flags)


@dataclass(frozen=True)
class HubAnswer:
    """The hub's answer about a model id: reachable, and whether the id exists there."""

    reachable: bool
    exists: bool
    detail: str = ""


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or os.sep in model and Path(model).expanduser().exists()


def hf_cached(model: str) -> bool:
    """Whether the hub id's config is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def ask_hub(model: str, timeout_s: float = 5.0) -> HubAnswer:
    """Ask the Hugging Face hub about `model`, giving up after `timeout_s`."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return HubAnswer(reachable=False, exists=False, detail="HF_HUB_OFFLINE is set")
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(model, timeout=timeout_s)
    except GatedRepoError as exc:
        return HubAnswer(reachable=True, exists=False, detail=f"gated: {exc}")
    except RepositoryNotFoundError:
        return HubAnswer(reachable=True, exists=False, detail="no such model on the hub")
    except Exception as exc:  # noqa: BLE001 - the hub client's network errors have no common base across versions
        return HubAnswer(reachable=False, exists=False, detail=f"{type(exc).__name__}: {exc}")
    return HubAnswer(reachable=True, exists=True)


# The tiny model compiles longer than it runs: eager mode starts a CPU replica in ~25 s instead of ~70 s. float32:
# in eager mode, vLLM's bfloat16 CPU path died with SIGILL on a one-token prompt on this machine (AMX in a VM).
TINY_MODEL_ARGS = (("--enforce-eager",), ("--dtype", "float32"))
SYNTHETIC_ARGS = (("--load-format", "dummy"),)  # random weights: nothing to download or read
# On the CPU build (tests, --quick) the same float32 and eager mode as the tiny model; on a GPU the model's own
# dtype and CUDA graphs, or the speed measured would not be the real model's.
SYNTHETIC_CPU_ARGS = (("--dtype", "float32"), ("--enforce-eager",))
SYNTHETIC_MAX_MODEL_LEN = 4096  # the hub configs allow up to 131072; vLLM would size for that by default


def tiny(requested: str, reason: str | None, tiny_dir: Path | None) -> ResolvedModel:
    path = ensure_tiny_model(tiny_dir)
    return ResolvedModel(requested, str(path), TINY_MODEL_NAME, offline=True, fallback_reason=reason,
                         flags=TINY_MODEL_ARGS, default_max_model_len=2048)


def tiny_embed(requested: str) -> ResolvedModel:
    """The tiny BERT embedding model (made locally), served by vLLM's pooling runner."""
    path = ensure_tiny_embedding_model()
    return ResolvedModel(requested, str(path), TINY_EMBED_NAME, offline=True,
                         flags=(("--runner", "pooling"), *TINY_MODEL_ARGS), default_max_model_len=512)


def synthetic(requested: str, cache: Path | None = None) -> ResolvedModel:
    """`synthetic:NAME`: the architecture's real config and a local tokenizer, served with random weights."""
    from synthetic.build import ensure_synthetic_model

    try:
        item = catalog.entry(requested)
    except catalog.UnknownModel as exc:
        raise ModelError(str(exc)) from None
    path = ensure_synthetic_model(item.name, cache)
    limit = int(item.config().get("max_position_embeddings") or SYNTHETIC_MAX_MODEL_LEN)
    return ResolvedModel(requested, str(path), item.served_name, offline=True, flags=SYNTHETIC_ARGS,
                         cpu_flags=SYNTHETIC_CPU_ARGS, default_max_model_len=min(limit, SYNTHETIC_MAX_MODEL_LEN))


def resolve(model: str, *, tiny_dir: Path | None = None, timeout_s: float = 5.0,
            hub: Callable[[str, float], HubAnswer] = ask_hub,
            cached: Callable[[str], bool] = hf_cached) -> ResolvedModel:
    """Resolve `model` to what vLLM loads; the tiny model stands in when the hub cannot be reached."""
    if model in TINY_ALIASES:
        return tiny(model, None, tiny_dir)
    if model == TINY_EMBED_NAME:
        return tiny_embed(model)
    if catalog.is_synthetic(model):
        return synthetic(model)
    if looks_like_path(model):
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ModelError(f"model {model!r} is not a model directory (no config.json there)")
        return ResolvedModel(model, str(path.resolve()), model)
    answer = hub(model, timeout_s)
    if answer.exists:
        return ResolvedModel(model, model, None)
    if answer.reachable:
        raise ModelError(f"model {model!r} cannot be loaded from the Hugging Face hub: {answer.detail}")
    if cached(model):
        logger.info("the hub is out of reach (%s); using the cached copy of %s", answer.detail, model)
        return ResolvedModel(model, model, None, offline=True)
    return tiny(model, f"the Hugging Face hub is out of reach ({answer.detail}) and {model} is not cached", tiny_dir)
