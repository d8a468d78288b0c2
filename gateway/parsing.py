"""Parse a request body once into a frozen `RequestInfo`; refuse bad input with a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from .affinity import completion_key, explicit_key, key_hash
from .config import PRIORITY_RANGE
from .errors import GatewayError, bad_request
from .tokens import BYTES_PER_TOKEN, CHAT_TOKENS_PER_MESSAGE, Count, TokenCounter


@dataclass(frozen=True)
class RequestInfo:
    """What routing and accounting need to know about one request."""

    model: str
    prompt_tokens: int
    max_tokens: int  # the whole output budget: per-choice max_tokens times n
    stream: bool
    prefix: int = 0  # the prompt prefix's affinity key (gateway/affinity.py); 0: none
    prefix_tokens: int = 0  # prompt tokens earlier requests with this key are expected to have left cached
    prefix_guessed: bool = False  # the key is a guess (a completions head): it means something once it recurs
    priority: int | None = None  # lower is served sooner (vLLM's convention); None: none given (parse: the body's)
    tenant: str = ""  # who it is for, when tenants are configured (gateway/tenancy.py); "": anonymous

    @property
    def cost(self) -> int:
        """Prompt tokens plus the whole output budget: what a replica reserves for it, what its tenant is charged
        at admission and asks for."""
        return self.prompt_tokens + self.max_tokens


def load_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 (msgspec: json.loads from bytes took half the parse time, measured)."""
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:  # msgspec raises the latter for bad UTF-8 in a string
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's answer to arrays or objects nested about 1000 deep
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(value)}", name)
    if value < minimum:
        raise bad_request(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model")
    return model


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise bad_request(f"'stream' must be a boolean, got {json.dumps(stream)}", "stream")
    return stream


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _text_tokens(prompt: Any, count: Count, param: str) -> int:
    """Tokens in a prompt given as a string, a list of strings, token ids, or lists of token ids (nothing deeper)."""
    if isinstance(prompt, str):
        return count(prompt)
    if _is_ids(prompt):
        return len(prompt)
    if isinstance(prompt, list):
        total = 0
        for item in prompt:
            if isinstance(item, str):
                total += count(item)
            elif _is_ids(item):
                total += len(item)
            else:
                break
        else:
            return total
    raise bad_request(f"'{param}' must be a string, a list of strings, a list of token ids or a list of lists of "
                      "token ids", param)


def chat_tokens(messages: Any, count: Callable[[str], int]) -> int:
    """Tokens in chat messages: their text (plain or content parts) plus what a chat template adds per message."""
    return chat_prompt(messages, count)[0]


def chat_prompt(messages: Any, count: Callable[[str], int]) -> tuple[int, int, int]:
    """Chat messages' tokens, affinity key and history tokens (see gateway/affinity.py)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    total = system = tokens = key = 0
    opening = True  # still in the system prompt and the opening message: they make the key
    for message in messages:
        if not isinstance(message, dict):
            raise bad_request("each message must be an object with 'role' and 'content'", "messages")
        content = message.get("content")
        tokens = CHAT_TOKENS_PER_MESSAGE
        if isinstance(content, str):
            tokens += count(content)
        elif isinstance(content, list):  # content parts: count the text ones
            parts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
            tokens += sum(count(text) for text in parts)
            content = "".join(parts)
        total += tokens
        if opening:
            role = message.get("role")
            key = key_hash(f"{role}\x00{content if isinstance(content, str) else ''}\x00".encode(), key)
            if role == "user":
                opening = False
            else:
                system += tokens
    if opening:
        return total, 0, 0  # no user message: nothing to key a conversation by
    return total, key, total - system - tokens  # history: the opening message and what followed, not the new one


def _priority(body: dict[str, Any]) -> int | None:
    value = body.get("priority")
    if value is None:
        return None
    lo, hi = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad_request(f"'priority' must be an integer in {lo}..{hi} (lower is served sooner), got "
                          f"{json.dumps(value)[:64]}", "priority")
    return value


def parse(raw: bytes, endpoint: str, counter: TokenCounter, default_max_tokens: int,
          check_model: Callable[[str], None] | None = None, priority: bool = False) -> RequestInfo:
    """Parse a /v1/completions, /v1/chat/completions or /v1/embeddings body.

    `check_model` may refuse the model (404) before any work that depends on it. `priority`: read the body's
    `priority` (vLLM's field) into `RequestInfo.priority`, checked; otherwise it is left to the replica.
    """
    body = load_json(raw)
    model = _model(body)
    if check_model is not None:
        check_model(model)
    given = _priority(body) if priority else None
    count = counter.counter(model, len(raw))
    if endpoint == "embeddings":
        if "input" not in body:
            raise bad_request("you must provide an input parameter", "input")
        return RequestInfo(model, _text_tokens(body["input"], count, "input"), 0, False, priority=given)
    stream = _stream(body)
    n = _int_field(body, "n", 1) or 1
    if endpoint == "chat":
        prompt_tokens, prefix, cached = chat_prompt(body.get("messages"), count)
        per_choice = _int_field(body, "max_completion_tokens", 0)
        if per_choice is None:
            per_choice = _int_field(body, "max_tokens", 0)
    else:
        if "prompt" not in body:
            raise bad_request("you must provide a prompt parameter", "prompt")
        prompt_tokens = _text_tokens(body["prompt"], count, "prompt")
        per_choice = _int_field(body, "max_tokens", 0)
        prefix, covered = completion_key(body["prompt"])
        cached = min(prompt_tokens, covered // BYTES_PER_TOKEN)
    budget = default_max_tokens if per_choice is None else per_choice
    explicit = explicit_key(body)
    guessed = endpoint != "chat" and not explicit and prefix != 0
    return RequestInfo(model, prompt_tokens, budget * n, stream, explicit or prefix, cached, guessed, given)


def other_info(raw: bytes) -> RequestInfo:
    """A request to another /v1 path: routed by its `model` when its body names one, and costing nothing."""
    model = ""
    if raw:
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.MsgspecError, UnicodeDecodeError):
            body = None
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            model = body["model"]
    return RequestInfo(model, 0, 0, False)


def not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
