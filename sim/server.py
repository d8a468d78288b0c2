"""OpenAI-compatible HTTP replicas over simulated engines, in real time (`sim serve`).

Each replica is one aiohttp application over one `Engine`; the engines of a node share one simulated GPU and
run on the event loop's clock, so tokens come out at the simulated pace: one SSE chunk per generated token.
Endpoints: `/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/metrics` (vLLM's names).

Prompt tokens are estimated from text (4 bytes per token, as the gateway does) or counted from token-id lists.
With prefix caching on, a prompt's 16-token blocks are 64-byte blocks of its text (a chat's messages rendered one
after another), chained, so prompts that share a head share cached blocks.
A request generates `max_tokens` tokens when it sets `ignore_eos`; otherwise it stops earlier, at a simulated
end of sequence drawn from a ShareGPT-like output length, with finish_reason "stop".
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from gateway.errors import GatewayError
from gateway.parsing import chat_tokens

from .engine import Engine, SimRequest
from .measured import FrontEnd, MeasuredStepTime
from .workload import REFERENCE_OUTPUT_MEAN

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4
TOKEN_TEXT = " tok"  # 4 bytes: a client re-estimating tokens from text gets the count back
TOKEN_TEXTS = (TOKEN_TEXT, " the", " a", " and", " x")  # with a tokenizer: the first it encodes as one token each
_EOS_SIGMA = 0.8


class Coder(Protocol):
    """A tokenizer: text to token ids."""

    def ids(self, text: str) -> list[int]: ...


class HFCoder:
    """A Hugging Face `tokenizers` tokenizer.json (a file, or the directory holding it)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        self._tok = Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))

    def ids(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def token_text(coder: Coder | None) -> str:
    """The text of one generated token. With the served model's tokenizer: a word it encodes as one token however
    often it repeats, so a reply sent back in a chat's history counts as many prompt tokens as were generated (OPT's
    tokenizer makes " tok" two: 'Ġto', 'k'). Without one: `TOKEN_TEXT`, a token by the 4-byte estimate."""
    if coder is not None:
        for text in TOKEN_TEXTS:
            if len(coder.ids(text * 8)) == 8:
                return text
    return TOKEN_TEXT


class BadRequest(Exception):
    """A client mistake: answered 400 (or `status`) with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class ReplicaState:
    """What one replica's app needs: its engine, its name, and a source of simulated EOS positions."""

    engine: Engine
    model_name: str
    rng: random.Random = field(default_factory=random.Random)
    created: int = field(default_factory=lambda: int(time.time()))
    coder: Coder | None = None  # the served model's tokenizer: exact prompt tokens and token-id blocks
    token_text: str = TOKEN_TEXT  # what one generated token reads as (`token_text(coder)`)
    frontend: FrontEnd | None = None  # the API server's queue before the engine sees a request
    eos_mu: float = math.log(REFERENCE_OUTPUT_MEAN) - _EOS_SIGMA**2 / 2
    requests_total: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=lambda: [0.0, 0.0])  # vLLM's time_to_first_token histogram (sum, count)

    def natural_length(self) -> int:
        """Where a request that does not ignore EOS would stop (lognormal, ShareGPT-like mean)."""
        return max(1, round(self.rng.lognormvariate(self.eos_mu, _EOS_SIGMA)))


STATE = web.AppKey("sim_replica", ReplicaState)


def estimate_tokens(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


def _prompts(prompt: Any, coder: Coder | None = None) -> list[int]:
    """Token counts of a completions `prompt`: a string, a list of strings, token ids, or lists of token ids."""
    count = estimate_tokens if coder is None else (lambda text: max(1, len(coder.ids(text))))
    if isinstance(prompt, str):
        return [count(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [len(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [count(p) for p in prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [len(p) for p in prompt]
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                     "prompt")


def _chat_tokens(messages: Any, coder: Coder | None = None) -> int:
    """The gateway's count of chat tokens (text plus template overhead), from bytes or the tokenizer."""
    try:
        return chat_tokens(messages, estimate_tokens if coder is None else lambda text: len(coder.ids(text)))
    except GatewayError as exc:
        raise BadRequest(exc.message, exc.param) from None


def _int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"'{name}' must be an integer >= {minimum}, got {json.dumps(value)}", name)
    return value


@dataclass(frozen=True)
class Parsed:
    """A generation request reduced to what the engine needs."""

    kind: str  # "completion" or "chat"
    prompts: list[int]  # prompt tokens per choice group
    texts: list[bytes]  # each prompt's content (what its prefix-cache blocks are cut from)
    n: int
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool


def parse(body: Any, kind: str, model_name: str, coder: Coder | None = None) -> Parsed:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model != model_name:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    if kind == "chat":
        prompts = [_chat_tokens(body.get("messages"), coder)]
        texts = [_rendered(body["messages"])]
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise BadRequest("you must provide a prompt parameter", "prompt")
        prompts = _prompts(body["prompt"], coder)
        texts = _texts(body["prompt"])
        max_tokens = _int(body, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = 16  # the OpenAI completions default, as vLLM
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    return Parsed(kind, prompts, texts, _int(body, "n", 1) or 1, max_tokens, bool(body.get("ignore_eos", False)),
                  stream, include_usage)


def _rendered(messages: list[Any]) -> bytes:
    """A chat's messages one after another, as a chat template lays them out (roles and texts)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role')}|>{content if isinstance(content, str) else ''}")
    return "".join(parts).encode()


def _texts(prompt: Any) -> list[bytes]:
    """The content of each prompt of a completions request (token ids as their decimal text)."""
    if isinstance(prompt, str):
        return [prompt.encode()]
    if all(isinstance(t, int) for t in prompt):
        return [json.dumps(prompt).encode()]
    return [p.encode() if isinstance(p, str) else json.dumps(p).encode() for p in prompt]


def block_hashes(text: bytes, tokens: int, block_size: int) -> Sequence[int]:
    """Chained hashes of the prompt's full blocks: `block_size` tokens of 4 bytes each, at most `tokens` tokens."""
    size = block_size * BYTES_PER_TOKEN
    hashes, prev = [], 0
    for start in range(0, min(len(text), tokens * BYTES_PER_TOKEN) - size + 1, size):
        prev = hash((prev, text[start:start + size]))
        hashes.append(prev)
    return hashes


def id_block_hashes(ids: Sequence[int], block_size: int) -> Sequence[int]:
    """Chained hashes of the full `block_size`-token blocks of a token-id sequence, as vLLM chains them."""
    hashes, prev = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(ids[start:start + block_size])))
        hashes.append(prev)
    return hashes


class _Choice:
    """One choice being generated: its engine request and the tokens not yet written to the client."""

    __slots__ = ("index", "req", "pending", "finish_reason", "done")

    def __init__(self, index: int, req: SimRequest, finish_reason: str) -> None:
        self.index, self.req, self.finish_reason = index, req, finish_reason
        self.pending = 0
        self.done = False


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = asyncio.get_running_loop().time()  # vLLM's arrival_time: the API server has the request
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "the request body is not valid JSON")
    try:
        parsed = parse(body, kind, state.model_name, state.coder)
        choices = _submit(state, parsed)
    except BadRequest as exc:
        return _error(exc.status, str(exc), exc.param)
    if state.frontend is not None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(state.frontend.admit(loop.time()) - loop.time())
    wake = asyncio.Event()
    frontend = state.frontend if parsed.stream and state.frontend is not None and state.frontend.streams_at_cost \
        else None
    whole = state.frontend if not parsed.stream else None  # a response sent whole takes its way out once
    for choice in choices:
        choice.req.on_token = _on_token(choice, wake, frontend)
        choice.req.on_finish = _on_finish(choice, wake, frontend, whole)
        state.engine.add(choice.req)
    refused = next((c.req.error for c in choices if c.req.error), None)
    if refused:
        for choice in choices:
            state.engine.abort(choice.req)
        return _error(400, refused, "max_tokens")
    try:
        if parsed.stream:
            return await _stream(request, state, parsed, choices, wake, merge=frontend is not None)
        while not all(c.done for c in choices):
            await wake.wait()
            wake.clear()
        return _full_response(state, parsed, choices)
    finally:
        for choice in choices:
            if not choice.done:
                state.engine.abort(choice.req)
            if choice.req.first_token_at is not None:  # from the API server's arrival to the engine's first token
                state.ttft[0] += choice.req.first_token_at - arrived
                state.ttft[1] += 1


def _submit(state: ReplicaState, parsed: Parsed) -> list[_Choice]:
    config = state.engine.config
    limit = config.max_model_len
    choices: list[_Choice] = []
    for prompt, text in zip(parsed.prompts, parsed.texts):
        blocks = None
        if config.enable_prefix_caching:
            blocks = block_hashes(text, prompt, config.block_size) if state.coder is None else \
                id_block_hashes(state.coder.ids(text.decode(errors="replace")), config.block_size)
        budget = parsed.max_tokens if parsed.max_tokens is not None else limit - prompt
        if prompt + budget > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{prompt + budget} tokens ({prompt} in the messages, {budget} in the completion). "
                             "Please reduce the length of the messages or completion.", "max_tokens")
        for _ in range(parsed.n):
            out, reason = budget, "length"
            if not parsed.ignore_eos:
                natural = state.natural_length()
                if natural < budget:
                    out, reason = natural, "stop"
            choices.append(_Choice(len(choices), SimRequest(prompt, out, blocks=blocks), reason))
    return choices


def _arrive(choice: _Choice, count: int, wake: asyncio.Event) -> None:
    choice.pending += count
    wake.set()


def _end(choice: _Choice, wake: asyncio.Event) -> None:
    choice.done = True
    wake.set()


def _on_token(choice: _Choice, wake: asyncio.Event, frontend: FrontEnd | None = None) -> Any:
    """Tokens reach the stream as the engine makes them, or, with a front end that streams at a cost, when it
    gets to them (a request's tokens waiting together go out as one chunk)."""
    def on_token(req: SimRequest, count: int) -> None:
        if frontend is None:
            _arrive(choice, count, wake)
            return
        loop = asyncio.get_running_loop()
        loop.call_at(frontend.deliver(loop.time(), req.rid), _arrive, choice, count, wake)
    return on_token


def _on_finish(choice: _Choice, wake: asyncio.Event, frontend: FrontEnd | None = None,
               whole: FrontEnd | None = None) -> Any:
    """The request is over when its last chunk reaches the stream (`frontend`: a front end that streams at a cost)
    or, for a response sent whole, after its way out (`whole`'s)."""
    def on_finish(req: SimRequest) -> None:
        if frontend is None:
            delay = whole.way_out(req.rid) if whole is not None else 0.0
            if delay > 0:
                asyncio.get_running_loop().call_later(delay, _end, choice, wake)
            else:
                _end(choice, wake)
            return
        loop = asyncio.get_running_loop()
        loop.call_at(max(loop.time(), frontend.until(req.rid)), _end, choice, wake)  # after its last token
        frontend.forget(req.rid)
    return on_finish


def _usage(choices: list[_Choice], parsed: Parsed) -> dict[str, int]:
    prompt = sum(parsed.prompts)
    completion = sum(c.req.generated for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk_choice(kind: str, index: int, text: str, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


async def _stream(request: web.Request, state: ReplicaState, parsed: Parsed, choices: list[_Choice],
                  wake: asyncio.Event, merge: bool = False) -> web.StreamResponse:
    """Stream the choices' tokens as they arrive; `merge`: the front end streams at a cost, and tokens that
    arrive together go out as one chunk, as vLLM's API server sends them."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    cid = f"{'chatcmpl' if parsed.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    obj = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
    head = {"id": cid, "object": obj, "created": int(time.time()), "model": state.model_name}
    if parsed.kind == "chat":
        for c in choices:
            role = {**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(role).encode() + b"\n\n")
    written = [0] * len(choices)
    while True:
        out = []
        for c in choices:
            while c.pending:
                n = c.pending if merge else 1
                c.pending -= n
                written[c.index] += n
                last = c.done and not c.pending and written[c.index] >= c.req.generated
                chunk = {**head, "choices": [_chunk_choice(parsed.kind, c.index, state.token_text * n,
                                                           c.finish_reason if last else None)]}
                out.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if out:
            await response.write(b"".join(out))
        if all(c.done and not c.pending for c in choices):
            break
        await wake.wait()
        wake.clear()
    if parsed.include_usage:
        usage = {**head, "choices": [], "usage": _usage(choices, parsed)}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _full_response(state: ReplicaState, parsed: Parsed, choices: list[_Choice]) -> web.Response:
    results = []
    for c in choices:
        text = state.token_text * c.req.generated
        if parsed.kind == "chat":
            results.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": c.finish_reason})
        else:
            results.append({"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason})
    prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
    return web.json_response({
        "id": f"{prefix}-{uuid.uuid4().hex}", "object": "chat.completion" if parsed.kind == "chat" else
        "text_completion", "created": int(time.time()), "model": state.model_name, "choices": results,
        "usage": _usage(choices, parsed)})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "vllm",
            "root": state.model_name, "parent": None, "max_model_len": state.engine.config.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


def render_metrics(state: ReplicaState) -> str:
    """vLLM's metric names (V1 and the older V0 usage name) and a few `sim:` extras."""
    e, cfg = state.engine, state.engine.config
    label = f'model_name="{state.model_name}"'
    kv_bytes = cfg.num_gpu_blocks * cfg.block_size * e.steptime.kv_bytes_per_token
    info = (f'block_size="{cfg.block_size}",num_gpu_blocks="{cfg.num_gpu_blocks}",'
            f'kv_cache_memory_bytes="{kv_bytes:.0f}",max_num_seqs="{cfg.max_num_seqs}",'
            f'max_num_batched_tokens="{cfg.max_num_batched_tokens}",'
            f'enable_prefix_caching="{cfg.enable_prefix_caching}"')
    lines = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", e.num_running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", e.num_waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage),
        ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage (V0 name). 1 means 100 percent usage.",
         e.kv_usage),
        ("vllm:num_preemptions", "counter", "Cumulative number of preemptions.", e.num_preemptions),
        ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", e.prompt_tokens_received),
        ("vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external).",
         e.prompt_tokens_cached),
        ("vllm:generation_tokens", "counter", "Number of generation tokens processed.", e.generation_tokens_total),
        ("vllm:request_success", "counter", "Count of successfully processed requests.", e.finished_total),
        ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
         e.prefix_cache_queries),
        ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
         e.prefix_cache_hits),
        ("sim:kv_blocks_used", "gauge", "KV blocks in use.", e.used_blocks),
        ("sim:gpu_device_active", "gauge", "Replicas with device work on the shared simulated GPU.",
         e.device.active),
        ("sim:gpu_busy_seconds", "counter", "Seconds the shared simulated GPU had device work.", e.device.busy_s),
    ]
    out = []
    for name, kind, help_, value in lines:
        sample = f"{name}_total" if kind == "counter" else name
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{sample}{{{label}}} {float(value)}"]
    # vLLM's histograms, their count and sum only: tokens per engine step (count: steps), and the request
    # timings that say where time to first token goes
    for name, help_, (total, count) in (
            ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
             (e.iteration_tokens_total, e.steps_total)),
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", state.ttft),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             e.queue_time),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             e.prefill_time)):
        out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram",
                f'{name}_bucket{{{label},le="+Inf"}} {float(count)}', f"{name}_count{{{label}}} {float(count)}",
                f"{name}_sum{{{label}}} {float(total)}"]
    out += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info}}} 1.0"]
    return "\n".join(out) + "\n"


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=render_metrics(request.app[STATE]), content_type="text/plain")


async def speed(request: web.Request) -> web.Response:
    """`POST /sim/speed {"scale": F}`: this replica's steps and front end F times what its replica model says (the
    machine F times slower than at the calibration; `bench.sim_vs_real --follow-speed` sets it before each run).
    Only a replica imitating a calibrated one (`sim serve --config`) has a model to scale."""
    state = request.app[STATE]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body must be JSON: {\"scale\": F}")
    scale = body.get("scale") if isinstance(body, dict) else None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.01 <= scale <= 100:
        return _error(400, "scale must be a number from 0.01 to 100", "scale")
    steptime = state.engine.steptime
    if not isinstance(steptime, MeasuredStepTime):
        return _error(400, "only a replica served from a replica model (sim serve --config) can be scaled")
    steptime.scale = float(scale)
    if state.frontend is not None:
        state.frontend.set_scale(float(scale))
    return web.json_response({"scale": steptime.scale})


def make_app(engine: Engine, model_name: str, seed: int | None = None, coder: Coder | None = None,
             frontend: FrontEnd | None = None) -> web.Application:
    """One simulated replica's aiohttp application; `frontend`: its API server's costs (`FrontEnd.of_model` of the
    engine and its `ReplicaModel`; none: a request reaches the engine, and a token its client, at once)."""
    app = web.Application()
    frontend = frontend if frontend is not None and frontend.costs else None
    app[STATE] = ReplicaState(engine, model_name, random.Random(seed), coder=coder, frontend=frontend,
                              token_text=token_text(coder))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/sim/speed", speed)
    return app
