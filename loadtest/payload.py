"""The OpenAI request bodies the load test sends."""

from __future__ import annotations

from typing import Any

from loadtest.chats import completion_prompt
from loadtest.workloads import RequestSpec


def request_body(model: str, endpoint: str, request: RequestSpec, ignore_eos: bool) -> dict[str, Any]:
    """A streaming completions or chat body for `request` (its adapter, if it names one, else `model`), asking the
    server to report usage."""
    body: dict[str, Any] = {
        "model": request.model or model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: generate exactly max_tokens
    if endpoint == "chat":
        history = [{"role": role, "content": text} for role, text in request.history]
        body["messages"] = [*history, {"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = completion_prompt(request.history, request.prompt) if request.history else request.prompt
    return body
