"""Bad input gets a 4xx with an OpenAI-style error body; never a 500, never a crash."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import FakeFactory, GatewayFactory


def assert_openai_error(body: dict[str, Any]) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]


@pytest.mark.parametrize(("path", "payload", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"model": 5, "prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"model": "fake-model"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "fake-model", "prompt": {"a": 1}}', 400, "prompt"),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/chat/completions", b'{"model": "fake-model"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": [1]}', 400, "messages"),
    ("/v1/chat/completions",
     b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5}',
     400, "max_completion_tokens"),
    ("/v1/embeddings", b'{"model": "fake-model"}', 400, "input"),
    ("/v1/completions", b'{"model": "no-such-model", "prompt": "x"}', 404, "model"),
    ("/v1/completions", b"\xff\xfe", 400, None),
    # found by fuzzing: invalid UTF-8 inside a JSON string or key made msgspec raise UnicodeDecodeError (a 500)
    ("/v1/completions", b'{"model": "fake-model", "prompt": "a\xdcb"}', 400, None),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": [], "max_t\x92\x94": 4}', 400, None),
    # found by fuzzing: a model name too long to be a file name made the tokenizer lookup raise OSError (a 500)
    ("/v1/completions", b'{"model": "%b", "prompt": "x"}' % (b"m" * 5000), 404, "model"),
])
async def test_bad_requests_get_openai_errors(path: str, payload: bytes, status: int, param: str | None,
                                              fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Each malformed request gets the right 4xx status and an error body naming the field."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + path, data=payload, headers={"Content-Type": "application/json"}) as resp:
            body = await resp.json()
            assert resp.status == status
    assert_openai_error(body)
    assert body["error"]["param"] == param
    assert fake.stats.bodies == []  # nothing bad reached the replica


async def test_bad_utf8_to_another_v1_path_is_forwarded(fake_replica: FakeFactory,
                                                        gateway_for: GatewayFactory) -> None:
    """A body with invalid UTF-8 to a /v1 path the gateway only forwards goes on to a replica (no 500)."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/other", data=b'{"model": "a\xdcb"}') as resp:
            assert resp.status == 404  # the fake's answer for a path it does not serve
            assert resp.headers["x-gateway-replica"] == fake.url


async def test_body_over_the_limit_is_413(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A body larger than max_body_bytes is refused with 413 before it reaches a replica."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], max_body_bytes=1000)
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions",
                                json={"model": "fake-model", "prompt": "x" * 5000}) as resp:
            body = await resp.json()
            assert resp.status == 413
    assert_openai_error(body)


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"),
    ("POST", "/health", None), ("GET", "/nowhere", None),
])
async def test_wrong_method_or_path(method: str, path: str, allowed: str | None, fake_replica: FakeFactory,
                                    gateway_for: GatewayFactory) -> None:
    """A wrong method gets 405 with Allow, an unknown path 404, both as OpenAI-style errors."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        async with session.request(method, gw.url + path) as resp:
            body = await resp.json()
            assert resp.status == (405 if allowed or path == "/health" else 404)
            if allowed:
                assert resp.headers["Allow"] == allowed
    assert_openai_error(body)


async def test_api_keys_are_enforced_and_upstream_key_sent(fake_replica: FakeFactory,
                                                           gateway_for: GatewayFactory) -> None:
    """Without a valid client key: 401 (openai.AuthenticationError); with one, the upstream key goes to the replica."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], api_keys=["sk-good"], upstream_api_key="sk-upstream")
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="sk-bad") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model="fake-model", prompt="x", max_tokens=1)
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="sk-good") as client:
        await client.completions.create(model="fake-model", prompt="x", max_tokens=1)
    assert len(fake.stats.bodies) == 1
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/health") as resp:
            assert resp.status == 200  # health stays open


async def test_no_healthy_replica_is_503(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """With every replica down, requests get a 503 OpenAI-style error, not a hang or a 500."""
    fake = await fake_replica(healthy=False)
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", json={"model": "fake-model", "prompt": "x"}) as resp:
            assert resp.status == 503
            assert_openai_error(json.loads(await resp.read()))
