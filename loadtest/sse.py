"""Metering an OpenAI streaming response: SSE lines in, TTFT / ITL / token counts out. Pure, no I/O.

A token chunk is a `data:` event carrying choice 0's text (completions) or delta content (chat), even
empty text: a token that decodes to nothing (a special token, a random-weight model's usual output, part of
a UTF-8 character) still left the engine at that moment, and `vllm bench serve` counts it too. Not tokens:
a chat delta that only announces the role, and an empty chunk that only carries the finish reason. Output
tokens are the server's `usage.completion_tokens` when the stream carries usage, else the number of token
chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class RequestFailed(Exception):
    """A request that did not complete; the message is the reason Locust groups failures by."""


@dataclass(frozen=True)
class StreamResult:
    """What a complete stream measured (times in seconds)."""

    ttft_s: float | None
    itl_s: tuple[float, ...]
    output_tokens: int
    prompt_tokens: int | None
    text: str = ""  # the reply (choice 0), for a conversation's next turn


class StreamMeter:
    """Feed it each line of the response body with its arrival time; `finish` gives the result."""

    def __init__(self, sent_s: float) -> None:
        self._sent_s = sent_s
        self._last_token_s: float | None = None
        self._ttft_s: float | None = None
        self._itl: list[float] = []
        self._chunks = 0
        self._usage: dict[str, Any] | None = None
        self._text: list[str] = []
        self.done = False

    @property
    def tokens_so_far(self) -> int:
        return self._chunks

    def feed(self, line: bytes, now: float) -> None:
        """Take one line; raises RequestFailed on an error event or data that is not JSON."""
        text = line.strip()
        if not text.startswith(b"data:"):
            return  # blank separators, comments (":"), event:/id: fields
        data = text[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise RequestFailed("bad SSE data: not JSON") from None
        if not isinstance(event, dict):
            raise RequestFailed("bad SSE data: not a JSON object")
        if "error" in event:
            raise RequestFailed(f"error event in stream: {_message(event['error'])}")
        if isinstance(event.get("usage"), dict):
            self._usage = event["usage"]
        token = _token_text(event)
        if token is not None:
            self._text.append(token)
            self._token(now)

    def _token(self, now: float) -> None:
        if self._last_token_s is None:
            self._ttft_s = now - self._sent_s
        else:
            self._itl.append(now - self._last_token_s)
        self._last_token_s = now
        self._chunks += 1

    def finish(self) -> StreamResult:
        """The result of a stream that ended; raises RequestFailed when [DONE] never came."""
        if not self.done:
            raise RequestFailed("stream ended before [DONE]")
        usage = self._usage or {}
        tokens = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        return StreamResult(
            ttft_s=self._ttft_s,
            itl_s=tuple(self._itl),
            output_tokens=tokens if isinstance(tokens, int) else self._chunks,
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            text="".join(self._text),
        )


def _token_text(event: dict[str, Any]) -> str | None:
    """Choice 0's new text when the event carries a token (possibly ""), else None."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if "text" in choice:
        text = str(choice.get("text") or "")
    else:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None
        text = str(delta.get("content") or delta.get("reasoning_content") or "")
        if not text and (not isinstance(delta.get("content"), str) or "role" in delta):
            return None  # a role announcement, or a delta with no content at all
    if not text and choice.get("finish_reason") is not None:
        return None  # only the finish reason
    return text


def _message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or error)[:200]
    return str(error)[:200]


def error_reason(status: int, body: bytes) -> str:
    """A short failure reason for an HTTP error answer, with the OpenAI error message when there is one."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and "error" in parsed:
        return f"HTTP {status}: {_message(parsed['error'])}"
    if isinstance(parsed, dict) and "message" in parsed:
        return f"HTTP {status}: {_message(parsed)}"
    snippet = body[:120].decode("utf-8", "replace").strip()
    return f"HTTP {status}: {snippet}" if snippet else f"HTTP {status}"
