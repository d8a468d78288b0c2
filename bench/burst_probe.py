"""What a burst costs an idle replica: k prompts sent at the same instant, split as vLLM splits a first token.

For each shape (k prompts of n tokens, sent together, `max_tokens` 1, random token ids so nothing is cached), on
an idle replica, `reps` times: the client's mean TTFT, and per request vLLM's own mean TTFT, queue and prefill
times (`vllm:time_to_first_token_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`; `sim
serve` exports the same). What is left of vLLM's TTFT after its queue and prefill is the API server's part: the
request's way in (tokenizing, handing over to the engine core) and its first token's way out. Medians over the reps.

Run it on a real replica and on `sim serve --config` of its calibration, side by side: a prompt alone shows the
front end and the prefill per token; prompts together show how the engine batches a burst.

`--background 0,4,16` probes a replica under load instead: with that many requests streaming long outputs
(`ignore_eos`, started before and dropped after), the prompts of `LOADED_SHAPES`, and before them the engine's
step with the streams alone. An API server that works for every streamed token delays a new request more the more
requests it streams.

    python -m bench.burst_probe --replica http://127.0.0.1:8001 [--reps 5] [--out runs/burst_probe.json]
    python -m bench.burst_probe --replica http://127.0.0.1:8001 --background 0,4,8,16,24
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .engine_speed import SAMPLED, counters
from .prefill_cost import complete, idle_replica_parser, served

SHAPES: dict[str, tuple[int, ...]] = {
    "1 x 128": (128,), "2 x 128": (128,) * 2, "4 x 128": (128,) * 4, "8 x 128": (128,) * 8,
    "1 x 512": (512,), "1 x 1024": (1024,), "1024 + 4 x 128": (1024,) + (128,) * 4}
LOADED_SHAPES = ("1 x 128", "4 x 128", "1 x 1024")
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

    def send_all() -> None:
        threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
        if errors:
            raise RuntimeError(f"{url}: {len(errors)} of {len(prompts)} requests failed: {errors[0]}")

    ttft, queue, prefill = vllm_means(url, send_all, len(prompts), f"{url}: a probe")
    return statistics.mean(times) * 1e3, ttft, queue, prefill


def vllm_means(url: str, run: Callable[[], None], expected: int, what: str) -> tuple[float, float, float]:
    """`run()`, which sends `expected` requests to the idle replica at `url`: vLLM's own TTFT, queue and prefill
    over it, means per request in ms, from its histograms' sums. `what` names the run in the error raised when
    the replica prefilled other requests meanwhile."""
    names = (TTFT, QUEUE, PREFILL, COUNT)
    before = counters([url], names)
    run()
    after = counters([url], names)
    count = after[COUNT] - before[COUNT]
    if count != expected:
        raise RuntimeError(f"{what} of {expected} requests, and the replica prefilled {count:g}: is it idle?")
    ttft, queue, prefill = ((after[name] - before[name]) / count * 1e3 for name in (TTFT, QUEUE, PREFILL))
    return ttft, queue, prefill


def medians(shape: str, rows: Sequence[tuple[float, float, float, float]]) -> Reading:
    """A shape's reading: the median of each of `probe`'s four figures over its reps."""
    client, ttft, queue, prefill = (statistics.median(r[i] for r in rows) for i in range(4))
    return Reading(shape, client, ttft, queue, prefill, reps=len(rows))


def warmed_up(url: str, seed: int) -> tuple[str, int | None, random.Random]:
    """The replica's model and context length, after its first request (which costs more than any later one), and
    the probes' random source."""
    model, max_model_len = served(url)
    rng = random.Random(seed)
    complete(url, model, [rng.randrange(4, 1000) for _ in range(16)], 60.0)
    return model, max_model_len, rng


def measure(url: str, reps: int, seed: int = 0) -> list[Reading]:
    """Every shape that fits the replica's context, `reps` times, on the idle replica at `url`."""
    model, max_model_len, rng = warmed_up(url, seed)
    readings = []
    for name, lengths in SHAPES.items():
        if max_model_len is not None and max(lengths) + 1 > max_model_len:
            continue
        reading = medians(name, [probe(url, model, lengths, rng) for _ in range(reps)])
        readings.append(reading)
        print(f"{name:>15}: client TTFT {reading.client_ttft_ms:6.1f} ms; vLLM's TTFT {reading.ttft_ms:6.1f} = "
              f"API server {reading.api_server_ms:5.1f} + queue {reading.queue_ms:5.1f} + prefill "
              f"{reading.prefill_ms:6.1f}", flush=True)
    return readings


class Background:
    """`n` requests streaming `tokens` tokens each (`ignore_eos`) for as long as the `with` block runs: entering
    waits until each has its first token; leaving closes their connections (the replica aborts them)."""

    def __init__(self, url: str, model: str, n: int, tokens: int, rng: random.Random, timeout_s: float = 60.0) -> None:
        self.url, self.model, self.tokens, self.timeout_s = url, model, tokens, timeout_s
        self.prompts = [[rng.randrange(4, 1000) for _ in range(16)] for _ in range(n)]
        self.chunks = [0] * n
        self.errors: list[BaseException] = []
        self._started = [threading.Event() for _ in range(n)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(n)]

    def _stream(self, i: int) -> None:
        body = json.dumps({"model": self.model, "prompt": self.prompts[i], "max_tokens": self.tokens, "stream": True,
                           "ignore_eos": True, "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                for line in resp:
                    if line.startswith(b"data: {"):
                        self.chunks[i] += 1
                        self._started[i].set()
                    if self._stop.is_set():
                        return
            if not self._stop.is_set():
                self.errors.append(RuntimeError(f"a background request ended after {self.chunks[i]} chunks"))
        except (urllib.error.URLError, OSError) as exc:
            self.errors.append(exc)
        finally:
            self._started[i].set()

    def __enter__(self) -> Background:
        for thread in self._threads:
            thread.start()
        for started in self._started:
            started.wait(self.timeout_s)
        if self.errors:
            raise RuntimeError(f"{self.url}: a background request failed: {self.errors[0]}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s)

    def check(self) -> None:
        if self.errors:
            raise RuntimeError(f"{self.url}: a background request failed or ended early: {self.errors[0]}")


@dataclass(frozen=True)
class Loaded:
    """The probes of `LOADED_SHAPES` with `background` requests streaming meanwhile; before them, over `window_s`
    with nothing else sent, the engine's mean step (its generated tokens over the time, per background request) and
    the background's tokens a chunk (above 1 where the API server merged tokens it had not yet sent)."""

    background: int
    step_ms: float
    tokens_a_chunk: float
    readings: tuple[Reading, ...]



def decoding(url: str, background: Background, window_s: float) -> tuple[float, float]:
    """The engine's mean step (ms) and the background's tokens a chunk over `window_s` with nothing else sent. Read
    apart from the probes: a real replica's /metrics costs its API server about 11 ms (the probes read it twice
    each), `sim serve`'s next to nothing, so a step read over the probes would not compare."""
    n = len(background.chunks)
    made, chunks, start = counters([url], (SAMPLED,))[SAMPLED], sum(background.chunks), time.perf_counter()
    time.sleep(window_s)
    made = counters([url], (SAMPLED,))[SAMPLED] - made
    took, chunks = time.perf_counter() - start, sum(background.chunks) - chunks
    if not n or made <= 0 or not chunks:
        return float("nan"), float("nan")
    return n * took / made * 1e3, made / chunks


def measure_loaded(url: str, backgrounds: Sequence[int], reps: int, seed: int = 0, window_s: float = 1.0,
                   shapes: Sequence[str] = LOADED_SHAPES) -> list[Loaded]:
    """`shapes` (of `SHAPES`), `reps` times each, under each count of background streams, on the replica at `url`."""
    model, max_model_len, rng = warmed_up(url, seed)
    tokens = min(max_model_len or 2048, 2048) - 17
    results = []
    for n in backgrounds:
        with Background(url, model, n, tokens, rng) as background:
            time.sleep(0.5)  # past the background's own prefills
            step_ms, per_chunk = decoding(url, background, window_s)
            readings = []
            for name in shapes:
                readings.append(medians(name, [probe(url, model, SHAPES[name], rng) for _ in range(reps)]))
            background.check()
        results.append(Loaded(n, step_ms, per_chunk, tuple(readings)))
        print(f"background {n:3d} (a step every {step_ms:5.1f} ms, {per_chunk:4.2f} tokens a chunk): " + "; ".join(
            f"{r.shape} TTFT {r.client_ttft_ms:6.1f} ms = API server {r.api_server_ms:5.1f} + queue {r.queue_ms:5.1f} "
            f"+ prefill {r.prefill_ms:6.1f}" for r in readings), flush=True)
    return results


def _finite(value: float) -> float | None:
    """JSON has no NaN: a figure not read (no streams, or no tokens made) is null."""
    return None if math.isnan(value) else value


def _row(reading: Reading) -> dict[str, object]:
    return {**asdict(reading), "api_server_ms": reading.api_server_ms}


def main(argv: Sequence[str] | None = None) -> int:
    parser = idle_replica_parser("python -m bench.burst_probe", __doc__, "an idle replica's URL (vLLM, or sim serve)",
                                 "write the readings here (JSON)")
    parser.add_argument("--background", help="comma-separated counts of requests streaming meanwhile (e.g. 0,4,16): "
                        "probe under that load instead of idle")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    try:
        backgrounds = [int(n) for n in args.background.split(",")] if args.background else []
    except ValueError:
        parser.error(f"--background: comma-separated counts, got {args.background!r}")
    if any(n < 0 for n in backgrounds):
        parser.error("--background: counts cannot be negative")
    url = args.replica.rstrip("/")
    try:
        if backgrounds:
            loaded = measure_loaded(url, backgrounds, args.reps, args.seed)
            record = {"replica": url, "loaded": [
                {"background": x.background, "step_ms": _finite(x.step_ms), "tokens_a_chunk": _finite(x.tokens_a_chunk),
                 "readings": [_row(r) for r in x.readings]} for x in loaded]}
        else:
            record = {"replica": url, "readings": [_row(r) for r in measure(url, args.reps, args.seed)]}
    except (urllib.error.URLError, OSError, KeyError, ValueError, RuntimeError) as exc:
        print(f"bench.burst_probe: {url}: {exc}", file=sys.stderr)
        return 1
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
