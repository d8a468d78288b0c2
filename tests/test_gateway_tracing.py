"""W3C trace context through the gateway, and its OpenTelemetry spans, against FAKE replicas and a FAKE collector."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from bench.otlp_collector import Collector, Span, otlp_collector
from gateway.app import running
from gateway.config import ConfigError, from_mapping
from tests.conftest import FakeFactory, GatewayFactory

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


@contextlib.asynccontextmanager
async def traced_gateway(replicas: list[Any], collector: Collector, **settings: Any) -> AsyncIterator[str]:
    """A gateway exporting spans to the collector; leaving the block flushes them."""
    config = from_mapping({"replicas": replicas, "host": "127.0.0.1", "port": 0,
                           "health": {"interval_s": 60, "timeout_s": 1},
                           "tracing": {"endpoint": collector.url, "timeout_s": 5}, **settings})
    async with running(config, grace_s=1) as (gateway, port):
        assert gateway.health is not None
        await gateway.health.probe_all()
        yield f"http://127.0.0.1:{port}"


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body, headers=headers or {}) as response:
            text = await response.text()
            return response.status, (await response.json()) if "json" in response.content_type else text


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    names: dict[str, list[Span]] = {}
    for span in spans:
        names.setdefault(span.name, []).append(span)
    return names


async def test_off_the_clients_trace_context_reaches_the_replica_unchanged(
        fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Tracing off: traceparent and tracestate go on as sent; a request without them gets none."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    status, _ = await post(gw.url, BODY, {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
    assert status == 200
    status, _ = await post(gw.url, BODY)
    assert status == 200
    assert fake.stats.trace_headers == [{"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}, {}]


@pytest.mark.parametrize("traceparent", [
    f"00-{TRACE.upper()}-{PARENT}-01",           # upper case
    f"00-{'0' * 32}-{PARENT}-01",                # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",                 # all-zero parent id
    f"ff-{TRACE}-{PARENT}-01",                   # the forbidden version
    f"00-{TRACE}-{PARENT}-01-extra",             # version 00 has four fields
    f"00-{TRACE[:-1]}-{PARENT}-01",              # short trace id
    "hello",
])
async def test_a_malformed_traceparent_is_a_400_and_reaches_no_replica(
        fake_replica: FakeFactory, gateway_for: GatewayFactory, traceparent: str) -> None:
    """A client whose trace would be lost learns it: 400 invalid_traceparent naming the header."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    status, body = await post(gw.url, BODY, {"traceparent": traceparent})
    assert status == 400
    assert body["error"]["code"] == "invalid_traceparent" and body["error"]["param"] == "traceparent"
    assert body["error"]["type"] == "invalid_request_error"
    assert fake.stats.bodies == []
    status, _ = await post(gw.url, BODY)  # the gateway goes on serving
    assert status == 200


async def test_a_later_version_with_more_fields_is_accepted(fake_replica: FakeFactory,
                                                            gateway_for: GatewayFactory) -> None:
    """W3C: a version other than 00 may carry more fields; the gateway passes it on."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    traceparent = f"01-{TRACE}-{PARENT}-01-future"
    status, _ = await post(gw.url, BODY, {"traceparent": traceparent})
    assert status == 200 and fake.stats.trace_headers == [{"traceparent": traceparent}]


async def test_spans_of_a_request_join_the_clients_trace_and_the_replica_continues_it(
        fake_replica: FakeFactory) -> None:
    """gateway.request under the client's span; pick and upstream under it; the replica's parent is the attempt."""
    fake = await fake_replica()
    with otlp_collector() as collector:
        async with traced_gateway([fake.url], collector) as url:
            status, _ = await post(url, {**BODY, "stream": True}, {"traceparent": TRACEPARENT, "tracestate": "v=1"})
            assert status == 200
        spans = by_name(collector.wait_for(lambda s: s.trace_id == TRACE) and collector.spans)
    request, = spans["gateway.request"]
    pick, = spans["gateway.pick"]
    upstream, = spans["gateway.upstream"]
    assert {s.trace_id for s in (request, pick, upstream)} == {TRACE}
    assert request.parent_span_id == PARENT and request.service == "smallserve-gateway"
    assert pick.parent_span_id == upstream.parent_span_id == request.span_id
    assert request.attributes["gen_ai.request.model"] == "fake-model" and request.attributes["gateway.stream"]
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert pick.attributes["gateway.policy"] == "prefix_affinity"
    assert pick.attributes["gateway.replica"] == fake.url and pick.attributes["gateway.replica.estimated_ttft_s"] > 0
    assert upstream.attributes["gateway.attempt"] == 1 and upstream.events == ("first byte",)
    assert "gateway.queue" not in spans
    sent, = fake.stats.trace_headers
    assert sent == {"traceparent": f"00-{TRACE}-{upstream.span_id}-01", "tracestate": "v=1"}


async def test_each_attempt_is_its_own_span_and_a_retry_says_why(fake_replica: FakeFactory) -> None:
    """A replica answering 503 and one answering 200: two upstream spans, the first an error with its reason."""
    bad, good = await fake_replica(fail="refuse"), await fake_replica()
    with otlp_collector() as collector:
        async with traced_gateway([bad.url, good.url], collector, policy="round_robin") as url:
            for _ in range(2):  # round robin: one of the two starts with the refusing replica
                status, _ = await post(url, BODY)
                assert status == 200
        attempts = collector.wait_for(lambda s: s.name == "gateway.upstream")
    retried = [s for s in attempts if s.attributes.get("gateway.retry_reason")]
    assert len(retried) == 1 and retried[0].error
    assert retried[0].attributes == {"gateway.replica": bad.url, "gateway.attempt": 1,
                                     "gateway.retry_reason": "status_503", "http.response.status_code": 502}
    second = [s for s in attempts if s.trace_id == retried[0].trace_id and s is not retried[0]]
    assert len(second) == 1 and second[0].attributes["gateway.attempt"] == 2 and not second[0].error
    assert second[0].attributes["gateway.replica"] == good.url


async def test_a_request_that_waited_has_a_queue_span(fake_replica: FakeFactory) -> None:
    """At its cap, a replica makes the next request wait: gateway.queue under that request's pick."""
    fake = await fake_replica(ttft_s=0.3)
    with otlp_collector() as collector:
        async with traced_gateway([{"url": fake.url, "max_requests": 1}], collector,
                                  queue={"max_size": 4, "max_wait_s": 5}) as url:
            results = await asyncio.gather(post(url, BODY), post(url, BODY))
            assert [status for status, _ in results] == [200, 200]
        spans = by_name(collector.wait_for(lambda s: s.name == "gateway.queue") and collector.spans)
    queue, = spans["gateway.queue"]
    picks = {s.span_id: s for s in spans["gateway.pick"]}
    assert queue.parent_span_id in picks and picks[queue.parent_span_id].trace_id == queue.trace_id


async def test_an_unsampled_request_records_nothing_and_says_so_downstream(fake_replica: FakeFactory) -> None:
    """Ratio 0: no spans; the replica gets a fresh traceparent with the sampled flag off. A client's 00 is kept."""
    fake = await fake_replica()
    with otlp_collector() as collector:
        async with traced_gateway([fake.url], collector, tracing={"endpoint": collector.url,
                                                                   "sampling_ratio": 0.0}) as url:
            assert (await post(url, BODY))[0] == 200
            assert (await post(url, BODY, {"traceparent": f"00-{TRACE}-{PARENT}-00"}))[0] == 200
            assert (await post(url, BODY, {"traceparent": TRACEPARENT}))[0] == 200  # the client's 01 wins
        recorded = collector.wait_for(lambda s: True, timeout_s=2)
    fresh, kept, sampled = (h["traceparent"] for h in fake.stats.trace_headers)
    assert fresh.endswith("-00") and TRACE not in fresh
    assert kept == f"00-{TRACE}-{PARENT}-00"
    assert sampled.startswith(f"00-{TRACE}-") and sampled.endswith("-01")
    assert {s.trace_id for s in recorded} == {TRACE}


async def test_a_failed_request_is_an_error_span(fake_replica: FakeFactory) -> None:
    """The only replica refuses and is ejected: the 503 the client gets is the request span's status, an error."""
    fake = await fake_replica(fail="refuse")
    with otlp_collector() as collector:
        async with traced_gateway([fake.url], collector, retry={"max_attempts": 2, "max_time_s": 5}) as url:
            status, body = await post(url, BODY, {"traceparent": TRACEPARENT})
            assert status == 503, body
        spans = by_name(collector.wait_for(lambda s: s.name == "gateway.request") and collector.spans)
    request, = spans["gateway.request"]
    assert request.error and request.attributes["http.response.status_code"] == 503
    assert spans["gateway.upstream"][0].attributes["gateway.retry_reason"] == "status_503"
    assert request.trace_id == TRACE


@pytest.mark.parametrize("tracing, message", [
    ({"endpoint": "collector:4318"}, r"must be an http\(s\) URL"),
    ({"endpoint": "http://c:4318/v1/traces", "protocol": "thrift"}, "http/protobuf or grpc"),
    ({"endpoint": "http://c:4318/v1/traces", "sampling_ratio": 1.5}, "between 0 and 1"),
    ({"endpoint": "http://c:4318/v1/traces", "service_name": ""}, "service_name"),
    ({"endpoint": "http://c:4318/v1/traces", "exporter": "x"}, "unknown key"),
])
def test_bad_tracing_settings_are_named(tracing: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping({"replicas": ["http://127.0.0.1:1"], "tracing": tracing})


def test_grpc_takes_host_and_port() -> None:
    config = from_mapping({"replicas": ["http://127.0.0.1:1"],
                           "tracing": {"endpoint": "collector:4317", "protocol": "grpc"}})
    assert config.tracing.endpoint == "collector:4317"


def test_the_tracing_section_survives_the_trip_to_the_workers() -> None:
    from gateway.config import to_mapping
    config = from_mapping({"replicas": ["http://127.0.0.1:1"],
                           "tracing": {"endpoint": "http://c:4318/v1/traces", "sampling_ratio": 0.01}})
    assert from_mapping(to_mapping(config)) == config
