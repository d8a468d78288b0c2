"""A closed loop on one replica, split as vLLM splits a first token: what `planner profile` measures at batch size B.

B clients start together; each sends `requests` requests one after another (a prompt of `prompt` random token ids,
`output` tokens streamed, `ignore_eos`), the next as soon as the last token of the one before is in. That is the
profile's sweep at one batch size. For each B, `reps` times: the client's TTFT (mean and median over the B x
`requests` requests) and vLLM's own TTFT, queue and prefill per request (the sums of
`vllm:time_to_first_token_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds` over the run, as
`bench.burst_probe` reads them). What vLLM's TTFT holds beyond its queue and prefill is the API server's part (the
way from the request's arrival to the engine core queueing it, mostly the wait for the step in progress); the
client's TTFT beyond vLLM's is the way in and out over HTTP.

Run it several times on a real replica and on `sim serve --config` of its calibration: the reps show how far the
closed loop's TTFT moves from one run to the next, which a calibration fitted to one profile cannot see.

    python -m bench.round_probe --replica http://127.0.0.1:8001 --batch-sizes 16,32 [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import http.client
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
from urllib.parse import urlsplit

from .burst_probe import vllm_means, warmed_up


@dataclass(frozen=True)
class Round:
    """One closed-loop run at `batch_size`, in ms: the client's TTFT (mean, median) and vLLM's per request."""

    batch_size: int
    requests: int
    client_ttft_mean_ms: float
    client_ttft_p50_ms: float
    ttft_ms: float
    queue_ms: float
    prefill_ms: float

    @property
    def api_server_ms(self) -> float:
        """vLLM's TTFT less its queue and prefill: the API server's part."""
        return self.ttft_ms - self.queue_ms - self.prefill_ms

    @property
    def outside_ms(self) -> float:
        """The client's mean TTFT less vLLM's: the request's way in and its first token's way out."""
        return self.client_ttft_mean_ms - self.ttft_ms


def first_token_s(url: str, model: str, prompt: list[int], output: int, timeout_s: float) -> float:
    """Stream one completion to its end; the seconds to its first token."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output, "ignore_eos": True, "stream": True,
                       "temperature": 0})
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        first = None
        while line := resp.readline():
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - started
        if first is None:
            raise RuntimeError("the stream ended without a token")
        return first
    finally:
        conn.close()


def closed_loop(url: str, model: str, batch_size: int, requests: int, prompt: int, output: int,
                rng: random.Random, timeout_s: float = 120.0) -> Round:
    """`batch_size` clients, `requests` each, one after another (see the module's text)."""
    seeds = [rng.random() for _ in range(batch_size)]
    firsts: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(seed: float) -> None:
        own = random.Random(seed)
        try:
            for _ in range(requests):
                took = first_token_s(url, model, [own.randrange(4, 1000) for _ in range(prompt)], output, timeout_s)
                with lock:
                    firsts.append(took)
        except (OSError, RuntimeError, http.client.HTTPException) as exc:
            errors.append(exc)

    def run() -> None:
        threads = [threading.Thread(target=client, args=(s,)) for s in seeds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s * requests)
        if errors:
            raise RuntimeError(f"{len(errors)} of {batch_size} clients failed: {errors[0]}")

    ttft, queue, prefill = vllm_means(url, run, batch_size * requests, f"a run at B = {batch_size}")
    return Round(batch_size, len(firsts), statistics.fmean(firsts) * 1e3, statistics.median(firsts) * 1e3,
                 ttft, queue, prefill)


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"comma-separated positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.round_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", required=True, help="an idle replica's URL (vLLM, or sim serve)")
    parser.add_argument("--batch-sizes", type=_positive_ints, default=[16, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="requests per client (the profile's: 4)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the runs here (JSON)")
    args = parser.parse_args(argv)
    for name in ("reps", "requests", "prompt"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.output < 2:
        parser.error("--output must be at least 2 (a first token and one more)")
    url = args.replica.rstrip("/")
    try:
        model, max_model_len, rng = warmed_up(url, args.seed)
        if max_model_len is not None and args.prompt + args.output > max_model_len:
            parser.error(f"--prompt + --output ({args.prompt + args.output}) exceeds the replica's context "
                         f"({max_model_len})")
        runs = []
        for _ in range(args.reps):
            for b in args.batch_sizes:
                run = closed_loop(url, model, b, args.requests, args.prompt, args.output, rng)
                runs.append(run)
                print(f"B {b:3d}: client TTFT {run.client_ttft_mean_ms:6.1f} ms (p50 {run.client_ttft_p50_ms:6.1f}); "
                      f"vLLM's {run.ttft_ms:6.1f} = API server {run.api_server_ms:5.1f} + queue {run.queue_ms:5.1f} "
                      f"+ prefill {run.prefill_ms:5.1f}; outside {run.outside_ms:5.1f}", flush=True)
    except (urllib.error.URLError, OSError, KeyError, ValueError, RuntimeError) as exc:
        print(f"bench.round_probe: {url}: {exc}", file=sys.stderr)
        return 1
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "replica": url, "workload": {"prompt": args.prompt, "output": args.output, "requests": args.requests},
            "runs": [{**asdict(r), "api_server_ms": r.api_server_ms, "outside_ms": r.outside_ms} for r in runs]},
            indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
