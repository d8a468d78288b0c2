"""The gateway's OpenAI API through the official `openai` client, against FAKE replicas."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from yarl import URL

from gateway.errors import upstream_error
from tests.conftest import FakeFactory, GatewayFactory


async def test_completion_through_openai_client(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A non-streaming completion comes back whole, with the replica named in a header."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        raw = await client.completions.with_raw_response.create(model="fake-model", prompt="hello", max_tokens=4)
        completion = raw.parse()
    assert completion.choices[0].text == " tok" * 4
    assert raw.headers["x-gateway-replica"] == fake.url
    assert raw.headers["x-request-id"]


async def test_streaming_chat_through_openai_client(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A streamed chat completion arrives token by token and ends cleanly."""
    fake = await fake_replica(itl_s=0.001)
    gw = await gateway_for([fake.url])
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
    assert pieces == [" tok"] * 5


async def test_streaming_completion_and_chat_non_streaming(fake_replica: FakeFactory,
                                                           gateway_for: GatewayFactory) -> None:
    """Streaming completions and non-streaming chat both work."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        stream = await client.completions.create(model="fake-model", prompt="x", max_tokens=3, stream=True)
        texts = [c.choices[0].text async for c in stream]
        chat = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert texts == [" tok"] * 3
    assert chat.choices[0].message.content == " tok tok"


async def test_request_fields_pass_through_untouched(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Every field the client sends reaches the replica exactly as sent."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    body = {"model": "fake-model", "prompt": "p", "max_tokens": 2, "n": 2, "logprobs": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "seed": 7, "custom_field": {"a": [1, 2]}}
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", json=body) as resp:
            text = await resp.text()
    assert fake.stats.bodies == [body]
    assert '"usage"' in text and text.endswith("data: [DONE]\n\n")


async def test_client_request_id_is_kept(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A request id sent by the client comes back unchanged."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/completions", headers={"x-request-id": "abc-123"},
                                json={"model": "fake-model", "prompt": "p"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-request-id"] == "abc-123"


async def test_models_is_the_union_of_healthy_replicas(fake_replica: FakeFactory,
                                                       gateway_for: GatewayFactory) -> None:
    """/v1/models lists each healthy replica's models once; an unhealthy replica's models drop out."""
    a = await fake_replica(model="model-a")
    b = await fake_replica(model="model-b")
    c = await fake_replica(model="model-a")
    d = await fake_replica(model="model-d", healthy=False)
    gw = await gateway_for([a.url, b.url, c.url, d.url])
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        models = [m.id async for m in client.models.list()]
    assert sorted(models) == ["model-a", "model-b"]


async def test_one_models_card_as_openai_serves_it(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """`client.models.retrieve` works through the gateway (vLLM's server has no /v1/models/{id}): a served model's
    card, a name with a slash in it included, and an OpenAI-style 404 for one that no replica serves."""
    a = await fake_replica(model="model-a")
    b = await fake_replica(model="org/model-b")
    gw = await gateway_for([a.url, b.url])
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        assert (await client.models.retrieve("model-a")).id == "model-a"
        assert (await client.models.retrieve("org/model-b")).id == "org/model-b"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("nope")
    assert missing.value.code == "model_not_found"
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/v1/models/") as resp:
            assert sorted(m["id"] for m in (await resp.json())["data"]) == ["model-a", "org/model-b"]


async def test_requests_go_only_to_replicas_serving_the_model(fake_replica: FakeFactory,
                                                              gateway_for: GatewayFactory) -> None:
    """Each request reaches only replicas that serve its model."""
    a = await fake_replica(model="model-a")
    b = await fake_replica(model="model-b")
    gw = await gateway_for([a.url, b.url])
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        for _ in range(4):
            await client.completions.create(model="model-b", prompt="x", max_tokens=1)
    assert len(a.stats.bodies) == 0 and len(b.stats.bodies) == 4


async def test_embeddings_and_other_v1_paths(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Embeddings are routed like completions; other /v1 paths are proxied to a replica."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        emb = await client.embeddings.create(model="fake-model", input=["a", "b"])
    assert len(emb.data) == 2
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.base_url + "/unknown/thing", json={"model": "fake-model"}) as resp:
            assert resp.status == 404  # the replica's own answer (FastAPI's {"detail": ...}), told OpenAI's way
            assert resp.headers["x-gateway-replica"] == fake.url
            assert await resp.json() == {"error": {"message": "Not Found", "type": "not_found_error", "param": None,
                                                   "code": "not_found"}}
        async with session.get(gw.url + "/tokenize") as resp:  # a method the replica does not serve there
            assert resp.status == 405
            error = (await resp.json())["error"]
            assert (error["type"], error["code"], error["message"]) == (
                "invalid_request_error", "method_not_allowed", "Method Not Allowed")


def test_a_replicas_error_is_told_openais_way_and_an_openai_style_one_passes_as_it_came() -> None:
    """FastAPI's `{"detail": ...}` (a string, or a validation error's list), vLLM's older `{"object": "error",
    "message": ...}` and plain text become `{"error": {...}}` with the replica's message; `{"error": {...}}` is
    left as it came (None)."""
    def error(status: int, body: bytes) -> dict[str, object]:
        rewritten = upstream_error(status, body)
        assert rewritten is not None
        return dict(json.loads(rewritten)["error"])

    assert upstream_error(400, b'{"error": {"message": "max_tokens too large", "type": "BadRequestError"}}') is None
    assert error(404, b'{"detail": "Not Found"}') == {"message": "Not Found", "type": "not_found_error",
                                                      "param": None, "code": "not_found"}
    assert error(422, b'{"detail": [{"loc": ["body"], "msg": "field required"}]}')["message"] == \
        '[{"loc": ["body"], "msg": "field required"}]'
    assert error(400, b'{"object": "error", "message": "bad", "type": "BadRequestError"}')["message"] == "bad"
    assert error(404, b"404: Not Found") == {"message": "404: Not Found", "type": "not_found_error", "param": None,
                                             "code": "not_found"}
    assert error(413, b"\xff\xfe")["type"] == "invalid_request_error"


async def test_vllm_paths_outside_v1_go_to_a_replica_of_the_model(fake_replica: FakeFactory,
                                                                  gateway_for: GatewayFactory) -> None:
    """vLLM's /tokenize (and the rest of its own API outside /v1) is proxied to a replica serving the body's
    model; /version to any; a path of neither is the gateway's 404."""
    a = await fake_replica(model="model-a")
    b = await fake_replica(model="model-b")
    gw = await gateway_for([a.url, b.url])
    async with aiohttp.ClientSession() as session:
        for model in ("model-a", "model-b", "model-b"):
            async with session.post(gw.url + "/tokenize", json={"model": model, "prompt": "one two three"}) as resp:
                assert resp.status == 200
                assert await resp.json() == {"count": 3, "tokens": [0, 1, 2], "max_model_len": 2048, "model": model}
        async with session.get(gw.url + "/version") as resp:
            assert resp.status == 200 and await resp.json() == {"version": "fake"}
        async with session.post(gw.url + "/tokenize", json={"model": "nope", "prompt": "x"}) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        async with session.get(gw.url + "/tokenizer_info") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"


async def test_clients_cannot_load_or_unload_adapters_on_replicas(fake_replica: FakeFactory,
                                                                 gateway_for: GatewayFactory) -> None:
    """vLLM's runtime adapter API is refused (403) however the path is spelled: a client's string is never a path
    a replica loads, and what the gateway loaded is not unloaded behind it."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    fake.stats.adapters["a0"] = "/registered/a0"
    async with aiohttp.ClientSession() as session:
        for path, body in [("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
                           ("/v1/load%5Flora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
                           ("/v1/load_lora_adapter/", {"lora_name": "x", "lora_path": "/etc"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a0"}),
                           ("/v1%2Funload_lora_adapter", {"lora_name": "a0"})]:
            async with session.post(URL(gw.url + path, encoded=True), json=body) as resp:  # as sent
                error = (await resp.json())["error"]
                assert (resp.status, error["type"], error["code"]) == (403, "permission_error", "forbidden"), path
    assert fake.stats.adapters == {"a0": "/registered/a0"} and not fake.stats.lora_events


async def test_a_percent_encoded_path_is_routed_as_the_replica_reads_it(fake_replica: FakeFactory,
                                                                         gateway_for: GatewayFactory) -> None:
    """/v1/%63ompletions is /v1/completions to vLLM, so the gateway parses it as one (its checks, its limits)
    instead of passing it through as some other /v1 path."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        async with session.post(URL(gw.url + "/v1/%63ompletions", encoded=True), json={"model": "fake-model"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["message"] == "you must provide a prompt parameter"
        body = {"model": "fake-model", "prompt": "p", "max_tokens": 2}
        async with session.post(URL(gw.url + "/v1/%63ompletions", encoded=True), json=body) as resp:
            assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == " tok" * 2
    assert len(fake.stats.bodies) == 1  # the first never reached it


async def test_health_ready_and_metrics(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """/health is up, /ready reflects replica health, /metrics is Prometheus text with the gateway's series."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        await session.post(gw.base_url + "/completions", json={"model": "fake-model", "prompt": "p"})
        assert (await session.get(gw.url + "/health")).status == 200
        assert (await session.get(gw.url + "/ready")).status == 200
        metrics = await (await session.get(gw.url + "/metrics")).text()
        fake.behavior.healthy = False
        assert gw.gateway.health is not None
        await gw.gateway.health.probe_all()
        not_ready = await session.get(gw.url + "/ready")
        assert not_ready.status == 503
    for name in ("gateway_requests_total", "gateway_request_duration_seconds_bucket",
                 "gateway_time_to_first_token_seconds", "gateway_replica_outstanding_tokens",
                 "gateway_replica_inflight_requests", "gateway_replica_prefill_tokens", "gateway_replica_healthy",
                 "gateway_queue_depth", "gateway_asyncio_tasks", "process_open_fds", "process_resident_memory_bytes"):
        assert name in metrics
    assert f'gateway_requests_total{{model="fake-model",replica="{fake.url}",status="200"}} 1.0' in metrics


@pytest.mark.parametrize("policy", ["least_outstanding_tokens", "round_robin", "random", "least_requests",
                                    "power_of_two"])
async def test_every_policy_serves_requests(policy: str, fake_replica: FakeFactory,
                                            gateway_for: GatewayFactory) -> None:
    """Each routing policy, chosen by name, serves requests across the replicas."""
    fakes = [await fake_replica() for _ in range(3)]
    gw = await gateway_for([f.url for f in fakes], policy=policy)
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        for _ in range(12):
            await client.completions.create(model="fake-model", prompt="x", max_tokens=1)
    assert sum(len(f.stats.bodies) for f in fakes) == 12
    assert all(r.outstanding == 0 and r.inflight == 0 for r in gw.gateway.router.replicas.values())
