"""Stream metering: TTFT, ITL and token counts from SSE lines, and the failure reasons."""

from __future__ import annotations

import json

import pytest

from loadtest.sse import RequestFailed, StreamMeter, error_reason


def _data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n"


def _text(text: str) -> bytes:
    return _data({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def _delta(content: str) -> bytes:
    return _data({"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]})


def test_completion_stream_gives_ttft_gaps_and_usage_tokens() -> None:
    """TTFT is first text chunk minus send; ITL the gaps between text chunks; tokens from usage."""
    meter = StreamMeter(sent_s=10.0)
    for line, at in [(b"\n", 10.1), (_text(" a"), 10.5), (b"\n", 10.5), (_text(" b"), 10.7),
                     (_text(" c"), 11.0), (_data({"choices": [], "usage": {"prompt_tokens": 5,
                                                                            "completion_tokens": 4}}), 11.0),
                     (b": keep-alive\n", 11.0), (b"data: [DONE]\n", 11.1)]:
        meter.feed(line, at)
    result = meter.finish()
    assert result.ttft_s == pytest.approx(0.5)
    assert result.itl_s == pytest.approx((0.2, 0.3))
    assert (result.output_tokens, result.prompt_tokens) == (4, 5)


def test_chat_stream_without_usage_counts_chunks() -> None:
    """Chat deltas count as tokens; without usage the token count is the number of content chunks."""
    meter = StreamMeter(sent_s=0.0)
    meter.feed(_data({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), 0.05)
    for i, at in enumerate((0.2, 0.3, 0.45)):
        meter.feed(_delta(f" t{i}"), at)
    meter.feed(b"data:[DONE]\r\n", 0.5)
    result = meter.finish()
    assert result.ttft_s == pytest.approx(0.2)
    assert result.itl_s == pytest.approx((0.1, 0.15))
    assert (result.output_tokens, result.prompt_tokens) == (3, None)


def test_tokens_that_decode_to_nothing_still_time_the_stream() -> None:
    """A random-weight model's special tokens stream as empty text: each is still a token (as vLLM's own
    benchmark counts them), where the first GPU run measured no TTFT at all; a finish-only chunk is not."""
    meter = StreamMeter(sent_s=0.0)
    for at in (0.3, 0.32, 0.35):
        meter.feed(_text(""), at)
    meter.feed(_data({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}), 0.36)
    meter.feed(_data({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}), 0.36)
    meter.feed(b"data: [DONE]\n", 0.37)
    result = meter.finish()
    assert result.ttft_s == pytest.approx(0.3)
    assert result.itl_s == pytest.approx((0.02, 0.03))
    assert (result.output_tokens, result.text) == (3, "")


def test_chat_role_and_finish_chunks_are_not_tokens_but_empty_content_is() -> None:
    """Chat: the role announcement (content "") and the closing empty delta are not tokens; an empty
    content delta is; without usage the count is the token chunks'."""
    meter = StreamMeter(sent_s=0.0)
    meter.feed(_data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), 0.1)
    meter.feed(_delta(""), 0.2)
    meter.feed(_delta("hi"), 0.25)
    meter.feed(_data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 0.3)
    meter.feed(b"data: [DONE]\n", 0.3)
    result = meter.finish()
    assert result.ttft_s == pytest.approx(0.2)
    assert result.itl_s == pytest.approx((0.05,))
    assert (result.output_tokens, result.text) == (2, "hi")


def test_stream_without_done_fails() -> None:
    """A stream that ends without [DONE] is a failure, with tokens seen so far kept."""
    meter = StreamMeter(sent_s=0.0)
    meter.feed(_text("x"), 0.1)
    with pytest.raises(RequestFailed, match=r"stream ended before \[DONE\]"):
        meter.finish()
    assert meter.tokens_so_far == 1


@pytest.mark.parametrize(("line", "reason"), [
    (_data({"error": {"message": "engine died", "type": "InternalServerError"}}), "error event in stream: engine died"),
    (b"data: {not json\n", "bad SSE data: not JSON"),
    (b"data: [1, 2]\n", "bad SSE data: not a JSON object"),
])
def test_bad_events_fail_with_their_reason(line: bytes, reason: str) -> None:
    """Error events and unparsable data fail the request with a short reason."""
    with pytest.raises(RequestFailed, match=reason):
        StreamMeter(0.0).feed(line, 0.1)


@pytest.mark.parametrize(("status", "body", "reason"), [
    (503, b'{"error": {"message": "overloaded", "type": "error", "code": 503}}', "HTTP 503: overloaded"),
    (400, b'{"object": "error", "message": "too long"}', "HTTP 400: too long"),
    (502, b"<html>bad gateway</html>", "HTTP 502: <html>bad gateway</html>"),
    (500, b"", "HTTP 500"),
])
def test_http_error_reasons_carry_the_openai_message(status: int, body: bytes, reason: str) -> None:
    """HTTP errors become 'HTTP <status>: <message>'."""
    assert error_reason(status, body) == reason
