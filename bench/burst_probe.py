"""What a burst costs an idle replica: k prompts sent at the same instant, split as vLLM splits a first token.

For each shape (k prompts of n tokens, sent together, `max_tokens` 1, random token ids so nothing is cached), on
an idle replica, `reps` times: the client's mean TTFT, and per request vLLM's own mean TTFT, queue and prefill
times (`vllm:time_to_first_token_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`; `sim
serve` exports the same). What is left of vLLM's TTFT after its queue and prefill is the API server's part: the
request's way in (tokenizing, handing over to the engine core) and its first token's way out. Medians over the reps.

Run it on a real replica and on `sim serve --config` of its calibration, side by side: a prompt alone shows the
front end and the prefill per token; prompts together show how the engine batches a burst.

    python -m bench.burst_probe --replica http://127.0.0.1:8001 [--reps 5] [--out runs/burst_probe.json]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .engine_speed import counters
from .prefill_cost import complete, idle_replica_parser, served

SHAPES: dict[str, tuple[int, ...]] = {
    "1 x 128": (128,), "2 x 128": (128,) * 2, "4 x 128": (128,) * 4, "8 x 128": (128,) * 8,
    "1 x 512": (512,), "1 x 1024": (1024,), "1024 + 4 x 128": (1024,) + (128,) * 4}
TTFT, QUEUE = "vllm:time_to_first_token_seconds_sum", "vllm:request_queue_time_seconds_sum"
PREFILL, COUNT = "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count"


@dataclass(frozen=True)
class Reading:
    """One shape's medians over its reps, in ms: the client's TTFT, and vLLM's TTFT, queue and prefill per request."""

    shape: str
    client_ttft_ms: float
    ttft_ms: float
    queue_ms: float
    prefill_ms: float
    reps: int

    @property
    def api_server_ms(self) -> float:
        """vLLM's TTFT less its queue and prefill: the API server's part."""
        return self.ttft_ms - self.queue_ms - self.prefill_ms


def probe(url: str, model: str, lengths: Sequence[int], rng: random.Random, timeout_s: float = 60.0
          ) -> tuple[float, float, float, float]:
    """The prompts of `lengths` sent at once: (client TTFT, vLLM TTFT, queue, prefill), means per request, in ms."""
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for n in lengths]
    times: list[float] = []
    errors: list[BaseException] = []

    def send(prompt: list[int]) -> None:
        started = time.perf_counter()
        try:
            complete(url, model, prompt, timeout_s)
        except (urllib.error.URLError, OSError) as exc:
            errors.append(exc)
        else:
            times.append(time.perf_counter() - started)

    before = counters([url], (TTFT, QUEUE, PREFILL, COUNT))
    threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise RuntimeError(f"{url}: {len(errors)} of {len(prompts)} requests failed: {errors[0]}")
    after = counters([url], (TTFT, QUEUE, PREFILL, COUNT))
    count = after[COUNT] - before[COUNT]
    if count != len(prompts):
        raise RuntimeError(f"{url} prefilled {count:g} requests during a probe of {len(prompts)}: is it idle?")
    per = {name: (after[name] - before[name]) / count * 1e3 for name in (TTFT, QUEUE, PREFILL)}
    return statistics.mean(times) * 1e3, per[TTFT], per[QUEUE], per[PREFILL]


def measure(url: str, reps: int, seed: int = 0) -> list[Reading]:
    """Every shape that fits the replica's context, `reps` times, on the idle replica at `url`."""
    model, max_model_len = served(url)
    rng = random.Random(seed)
    complete(url, model, [rng.randrange(4, 1000) for _ in range(16)], 60.0)  # the first request's warm-up
    readings = []
    for name, lengths in SHAPES.items():
        if max_model_len is not None and max(lengths) + 1 > max_model_len:
            continue
        rows = [probe(url, model, lengths, rng) for _ in range(reps)]
        reading = Reading(name, *(statistics.median(r[i] for r in rows) for i in range(4)), reps=reps)
        readings.append(reading)
        print(f"{name:>15}: client TTFT {reading.client_ttft_ms:6.1f} ms; vLLM's TTFT {reading.ttft_ms:6.1f} = "
              f"API server {reading.api_server_ms:5.1f} + queue {reading.queue_ms:5.1f} + prefill "
              f"{reading.prefill_ms:6.1f}", flush=True)
    return readings


def main(argv: Sequence[str] | None = None) -> int:
    parser = idle_replica_parser("python -m bench.burst_probe", __doc__, "an idle replica's URL (vLLM, or sim serve)",
                                 "write the readings here (JSON)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    url = args.replica.rstrip("/")
    try:
        readings = measure(url, args.reps, args.seed)
    except (urllib.error.URLError, OSError, KeyError, ValueError, RuntimeError) as exc:
        print(f"bench.burst_probe: {url}: {exc}", file=sys.stderr)
        return 1
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(r), "api_server_ms": r.api_server_ms} for r in readings]
        args.out.write_text(json.dumps({"replica": url, "readings": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
