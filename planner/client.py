"""An async streaming client that times each completion: TTFT, inter-token gaps, end to end, token counts.

B workers pull from one list of requests (a closed loop at concurrency B, like the papers' "B requests in
flight"); each request streams `/v1/completions` with `stream_options.include_usage`, so token counts come
from the server, not from counting chunks. Drive it through a `load_session()`: aiohttp's default session holds
at most 100 connections, so a closed loop of B > 100 would keep only 100 requests at the server and time the rest's
wait for a connection as their TTFT.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from planner.workload import RequestSpec

logger = logging.getLogger(__name__)


def load_session() -> aiohttp.ClientSession:
    """A session with no cap on its connections, for driving load: the load's own concurrency is the cap.

    aiohttp's default connector holds at most 100 connections (`TCPConnector(limit=100)`). Every request beyond
    them waits in the pool, on the client, with its clock running, and whatever else shares the session (the
    `/metrics` scrapes) waits behind the streams. Measured once here (2026-11-30) with this client at B = 256
    against a fake replica streaming a 0.3 s answer: 100 requests at the server, mean TTFT 705 ms against a 206 ms
    median; without the cap, 256 and 232 ms. tests/test_planner_profile.py and test_planner_multiclient.py hold
    more than 100 in flight."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


@dataclass(frozen=True)
class Timeouts:
    """Seconds to connect, between two chunks of a stream, and for a whole request."""

    connect_s: float = 10.0
    idle_s: float = 300.0
    request_s: float = 900.0

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.request_s, sock_connect=self.connect_s, sock_read=self.idle_s)


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it (times in seconds; `error` set when it failed)."""

    start: float
    end: float
    ttft_s: float | None = None
    gaps_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadResult:
    """Every request of one run and the wall time from the first start to the last end."""

    results: tuple[RequestResult, ...]
    concurrency: int
    client_cpu_s: float | None = None  # the clients' CPU seconds over the run, where they were measured

    @property
    def duration_s(self) -> float:
        if not self.results:
            return 0.0
        return max(r.end for r in self.results) - min(r.start for r in self.results)


def _body(model: str, request: RequestSpec) -> dict[str, object]:
    body: dict[str, object] = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                               "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if request.ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_completion(session: aiohttp.ClientSession, base_url: str, model: str,
                            request: RequestSpec, timeouts: Timeouts) -> RequestResult:
    """Send one streaming completion and time it; failures are returned, not raised."""
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    usage: dict[str, int] = {}
    try:
        async with session.post(f"{base_url}/v1/completions", json=_body(model, request),
                                timeout=timeouts.client_timeout()) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                return RequestResult(start, time.perf_counter(), error=f"HTTP {response.status}: {text}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if chunk.get("choices"):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as exc:
        return RequestResult(start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(start, end, error="the stream carried no tokens")
    output = int(usage.get("completion_tokens") or len(gaps) + 1)
    return RequestResult(start, end, ttft_s=first - start, gaps_s=tuple(gaps),
                         prompt_tokens=int(usage.get("prompt_tokens") or 0), output_tokens=output)


async def run_load(session: aiohttp.ClientSession, base_url: str, model: str, requests: Sequence[RequestSpec],
                   concurrency: int, timeouts: Timeouts,
                   on_done: Callable[[RequestResult], None] | None = None) -> LoadResult:
    """Run `requests` with at most `concurrency` in flight; every request is tried once."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = iter(requests)
    results: list[RequestResult] = []

    async def worker() -> None:
        for request in pending:  # the iterator is shared: each request goes to exactly one worker
            result = await stream_completion(session, base_url, model, request, timeouts)
            results.append(result)
            if on_done is not None:
                on_done(result)

    workers = min(concurrency, len(requests))
    await asyncio.gather(*(worker() for _ in range(workers)))
    return LoadResult(tuple(results), workers)


async def served_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id `/v1/models` lists."""
    async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        response.raise_for_status()
        data = await response.json()
    models = data.get("data") or []
    if not models:
        raise aiohttp.ClientError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])
