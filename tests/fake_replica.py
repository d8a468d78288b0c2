"""A FAKE vLLM replica for fast tests, fault injection and benchmarks.

It speaks enough of vLLM's OpenAI server to stand in for it where the real thing is not the point:
`/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE or JSON), `/v1/embeddings`
and `/metrics` with vLLM's metric names. Every response yields `max_tokens` tokens (default 16), one SSE
chunk per token, paced by `ttft_s` and `itl_s`. Failures are injected through `FakeBehavior.fail`:

- "refuse": answer 503 before anything else (vLLM overloaded / not ready).
- "error": answer 500.
- "stall": accept the request and never answer.
- "die_midstream": send `die_after` chunks, then drop the connection.
- "stall_midstream": send `die_after` chunks, then go silent with the connection open.

`max_running` (like vLLM's max_num_seqs) makes requests beyond it wait; `/metrics` reports the requests running
and waiting as they are.

Run standalone (for Locust and benchmarks): `python -m tests.fake_replica --port 9001 --itl 0.01`
(`--fail MODE` injects a failure). `GET /fake/stats` returns what it saw (arrival times on the
machine's monotonic clock, max concurrency), so a test in another process can check the offered load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler

MODEL = "fake-model"


@dataclass
class FakeBehavior:
    """Knobs a test may turn while the fake runs."""

    model: str = MODEL
    ttft_s: float = 0.0
    itl_s: float = 0.0
    default_tokens: int = 16
    fail: str | None = None  # None, "refuse", "error", "stall", "die_midstream", "stall_midstream"
    die_after: int = 2
    healthy: bool = True
    root: str | None = None  # the model card's `root` (vLLM: the path or id the model was loaded from)
    metrics_page: str | None = None  # serve this text as /metrics instead of the live counts (a real vLLM page)
    max_running: int | None = None  # like vLLM's max_num_seqs: requests beyond it wait (and /metrics says so)
    lora_load_s: float = 0.0  # how long /v1/load_lora_adapter takes
    lora_fail: bool = False  # /v1/load_lora_adapter answers 404 (as vLLM does for a path with no adapter)
    stop_after: int | None = None  # answers end after this many tokens, whatever max_tokens allows (an early stop)


@dataclass
class FakeStats:
    """What the fake saw: request bodies and arrival times, and what is running now."""

    bodies: list[dict] = field(default_factory=list)
    trace_headers: list[dict[str, str]] = field(default_factory=list)  # traceparent/tracestate, per request
    arrivals: list[float] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    max_running: int = 0
    aborted: int = 0
    finished: int = 0
    health_probes: int = 0
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters loaded now: name -> path
    lora_events: list[tuple[str, str]] = field(default_factory=list)  # ("load" | "unload", name), in order
    max_adapters: int = 0  # the most adapters loaded at once


BEHAVIOR = web.AppKey("behavior", FakeBehavior)
STATS = web.AppKey("stats", FakeStats)


def _tokens(body: dict, behavior: FakeBehavior) -> int:
    value = body.get("max_tokens") or body.get("max_completion_tokens")
    tokens = int(value) if isinstance(value, int) and value > 0 else behavior.default_tokens
    return tokens if behavior.stop_after is None else min(tokens, behavior.stop_after)


def _choice(kind: str, index: int, text: str, finish: str | None) -> dict:
    if kind == "chat":
        return {"index": index, "delta": {"content": text}, "finish_reason": finish}
    return {"index": index, "text": text, "finish_reason": finish}


def _final_choice(kind: str, index: int, text: str) -> dict:
    if kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    return {"index": index, "text": text, "finish_reason": "length"}


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    behavior, stats = request.app[BEHAVIOR], request.app[STATS]
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return _error(400, "invalid JSON")
    stats.bodies.append(body)
    stats.trace_headers.append({k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))})
    stats.arrivals.append(time.monotonic())
    if body.get("model") != behavior.model and body.get("model") not in stats.adapters:
        return _error(404, f"The model `{body.get('model')}` does not exist.")
    if behavior.fail == "refuse":
        return _error(503, "overloaded")
    if behavior.fail == "error":
        return _error(500, "internal error")
    if behavior.max_running is not None:
        stats.waiting += 1
        try:
            while stats.running >= behavior.max_running:
                await asyncio.sleep(0.005)
        finally:
            stats.waiting -= 1
    stats.running += 1
    stats.max_running = max(stats.max_running, stats.running)
    try:
        if behavior.fail == "stall":
            await asyncio.sleep(3600)
        n_tokens = _tokens(body, behavior)
        n_choices = int(body.get("n") or 1)
        if body.get("stream"):
            return await _stream(request, body, kind, n_tokens, n_choices)
        await asyncio.sleep(behavior.ttft_s + behavior.itl_s * max(n_tokens - 1, 0))
        stats.finished += 1
        return web.json_response(_completion(body, kind, n_tokens, n_choices))
    except (asyncio.CancelledError, ConnectionResetError):
        stats.aborted += 1
        raise
    finally:
        stats.running -= 1


def _completion(body: dict, kind: str, n_tokens: int, n_choices: int) -> dict:
    text = " tok" * n_tokens
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [_final_choice(kind, i, text) for i in range(n_choices)],
        "usage": {"prompt_tokens": 8, "completion_tokens": n_tokens * n_choices, "total_tokens": 8 + n_tokens * n_choices},
    }


async def _stream(request: web.Request, body: dict, kind: str, n_tokens: int, n_choices: int) -> web.StreamResponse:
    behavior, stats = request.app[BEHAVIOR], request.app[STATS]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    await asyncio.sleep(behavior.ttft_s)
    for i in range(n_tokens):
        if i and behavior.itl_s:
            await asyncio.sleep(behavior.itl_s)
        if behavior.fail == "stall_midstream" and i >= behavior.die_after:
            await asyncio.sleep(3600)
        if behavior.fail == "die_midstream" and i >= behavior.die_after:
            assert request.transport is not None
            request.transport.close()
            stats.aborted += 1
            return response
        finish = "length" if i == n_tokens - 1 else None
        for c in range(n_choices):
            chunk = {"id": cid, "object": obj, "created": created, "model": body["model"],
                     "choices": [_choice(kind, c, " tok", finish)]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"id": cid, "object": obj, "created": created, "model": body["model"], "choices": [],
                 "usage": {"prompt_tokens": 8, "completion_tokens": n_tokens * n_choices,
                           "total_tokens": 8 + n_tokens * n_choices}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    stats.finished += 1
    return response


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "error", "param": None, "code": status}},
                             status=status)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def embeddings(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[STATS].bodies.append(body)
    inputs = body.get("input")
    count = len(inputs) if isinstance(inputs, list) else 1
    data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(count)]
    return web.json_response({"object": "list", "data": data, "model": body.get("model"),
                              "usage": {"prompt_tokens": count, "total_tokens": count}})


async def models(request: web.Request) -> web.Response:
    name, root = request.app[BEHAVIOR].model, request.app[BEHAVIOR].root
    adapters = [{"id": a, "object": "model", "created": 0, "owned_by": "vllm", "root": path, "parent": name}
                for a, path in request.app[STATS].adapters.items()]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": root or name,
         "parent": None, "max_model_len": 2048}, *adapters]})


async def load_lora(request: web.Request) -> web.Response:
    """vLLM's answers: 200 text, 400 when loaded already, 404 when the path holds no adapter."""
    behavior, stats = request.app[BEHAVIOR], request.app[STATS]
    body = await request.json()
    name, path = body.get("lora_name"), body.get("lora_path")
    await asyncio.sleep(behavior.lora_load_s)
    if name in stats.adapters:
        return _error(400, f"The lora adapter '{name}' has already been loaded.")
    if behavior.lora_fail:
        return _error(404, f"Loading lora {name} failed: No adapter found for {path}")
    stats.adapters[name] = path
    stats.lora_events.append(("load", name))
    stats.max_adapters = max(stats.max_adapters, len(stats.adapters))
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora(request: web.Request) -> web.Response:
    stats = request.app[STATS]
    name = (await request.json()).get("lora_name")
    if stats.adapters.pop(name, None) is None:
        return _error(404, f"The lora adapter '{name}' cannot be found.")
    stats.lora_events.append(("unload", name))
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize, a token a word, answered with the model that served it."""
    words = str((await request.json()).get("prompt", "")).split()
    return web.json_response({"count": len(words), "tokens": list(range(len(words))), "max_model_len": 2048,
                              "model": request.app[BEHAVIOR].model})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "fake"})


async def health(request: web.Request) -> web.Response:
    behavior = request.app[BEHAVIOR]
    request.app[STATS].health_probes += 1
    if behavior.fail == "stall":
        await asyncio.sleep(3600)
    return web.Response(status=200 if behavior.healthy and behavior.fail != "error" else 503)


async def fake_stats(request: web.Request) -> web.Response:
    stats = request.app[STATS]
    return web.json_response({"arrivals": stats.arrivals, "running": stats.running, "max_running": stats.max_running,
                              "finished": stats.finished, "aborted": stats.aborted, "bodies": stats.bodies})


async def metrics(request: web.Request) -> web.Response:
    stats, name = request.app[STATS], request.app[BEHAVIOR].model
    if request.app[BEHAVIOR].metrics_page is not None:
        return web.Response(text=request.app[BEHAVIOR].metrics_page, content_type="text/plain")
    label = f'{{model_name="{name}"}}'
    text = (
        f"vllm:num_requests_running{label} {stats.running}.0\n"
        f"vllm:num_requests_waiting{label} {stats.waiting}.0\n"
        f"vllm:kv_cache_usage_perc{label} {min(stats.running / 256, 1.0)}\n"
        f"vllm:num_preemptions_total{label} 0.0\n"
    )
    return web.Response(text=text, content_type="text/plain")


@web.middleware
async def fastapi_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A path or method the fake does not serve answers as vLLM's FastAPI server does: `{"detail": ...}`."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        return web.json_response({"detail": exc.reason}, status=exc.status)


def make_app(behavior: FakeBehavior | None = None) -> web.Application:
    """Build the fake replica's aiohttp application."""
    app = web.Application(middlewares=[fastapi_errors])
    app[BEHAVIOR] = behavior or FakeBehavior()
    app[STATS] = FakeStats()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/fake/stats", fake_stats)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a FAKE vLLM replica (for tests and benchmarks).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument("--tokens", type=int, default=16, help="tokens when the request names no max_tokens")
    parser.add_argument("--fail", choices=["refuse", "error", "stall", "die_midstream"], default=None,
                        help="inject this failure into every generation request")
    parser.add_argument("--die-after", type=int, default=2, help="die_midstream: chunks sent before dying")
    parser.add_argument("--metrics-page", metavar="FILE", help="serve this file as /metrics (a real vLLM page)")
    args = parser.parse_args(argv)
    page = open(args.metrics_page).read() if args.metrics_page else None
    behavior = FakeBehavior(model=args.model, ttft_s=args.ttft, itl_s=args.itl, default_tokens=args.tokens,
                            fail=args.fail, die_after=args.die_after, metrics_page=page)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_app(behavior), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
