"""bench/tail_parts.py: one request's time to first token split by its gateway and vLLM spans (made-up spans)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.otlp_collector import Span, spooling_collector
from bench.tail_parts import Parts, medians, new_trace, split, table


def span(name: str, trace: str, start_ms: float = 0.0, end_ms: float = 0.0, **attributes: float) -> Span:
    return Span("svc", name, trace, "s", "", 1, dict(attributes), (), False, int(start_ms * 1e6), int(end_ms * 1e6))


def test_a_new_trace_is_sampled_and_carries_its_id() -> None:
    trace, parent = new_trace()
    assert len(trace) == 32 and parent.startswith(f"00-{trace}-") and parent.endswith("-01")
    assert new_trace()[0] != trace


def test_the_parts_add_up_to_what_the_client_saw() -> None:
    spans = [span("gateway.request", "a", **{"gen_ai.latency.time_to_first_token": 0.050}),
             span("gateway.queue", "a", 1000.0, 1030.0),
             span("llm_request", "a", **{"gen_ai.latency.time_in_queue": 0.002,
                                         "gen_ai.latency.time_to_first_token": 0.012}),
             span("gateway.request", "b", **{"gen_ai.latency.time_to_first_token": 0.020}),  # vLLM's span missing
             span("llm_request", "other", **{"gen_ai.latency.time_to_first_token": 0.5})]
    parts = split(spans, {"a": 0.055, "b": 0.030})
    assert set(parts) == {"a"}
    a = parts["a"]
    assert a.gateway_queue == pytest.approx(0.030)
    assert a.client == pytest.approx(0.005) and a.path == pytest.approx(0.008)
    assert a.engine_queue == pytest.approx(0.002) and a.engine_work == pytest.approx(0.010)
    assert a.client + a.gateway_queue + a.path + a.engine_queue + a.engine_work == pytest.approx(a.client_ttft)


def test_a_request_that_did_not_queue_has_no_queue_part() -> None:
    spans = [span("gateway.request", "a", **{"gen_ai.latency.time_to_first_token": 0.02}),
             span("llm_request", "a", **{"gen_ai.latency.time_to_first_token": 0.015})]
    assert split(spans, {"a": 0.021})["a"].gateway_queue == 0.0


def test_medians_and_the_table() -> None:
    parts = [Parts(0.020, 0.018, 0.0, 0.0, 0.010), Parts(0.060, 0.055, 0.040, 0.001, 0.011),
             Parts(0.030, 0.028, 0.010, 0.0, 0.012)]
    m = medians(parts)
    assert m["client_ttft"] == pytest.approx(0.030) and m["gateway_queue"] == pytest.approx(0.010)
    assert medians([]) == {}
    lines = table({"slower": (3, m), "none": (0, {})})
    assert lines[0].startswith("| requests | n | TTFT |") and "gateway queue" in lines[0]
    assert lines[2].startswith("| slower | 3 | 30.0 | ") and lines[3] == "| none | 0 | " + " | ".join([""] * 6) + " |"


def test_the_spooling_collector_keeps_exports_in_its_own_process(tmp_path: Path) -> None:
    """What an exporter posts comes back as spans, read from the spool after the fact."""
    message = ExportTraceServiceRequest()
    resource = message.resource_spans.add()
    attribute = resource.resource.attributes.add()
    attribute.key, attribute.value.string_value = "service.name", "gw"
    one = resource.scope_spans.add().spans.add()
    one.name, one.trace_id, one.span_id = "gateway.queue", bytes.fromhex("ab" * 16), bytes.fromhex("cd" * 8)
    one.start_time_unix_nano, one.end_time_unix_nano = 1_000_000_000, 1_030_000_000
    with spooling_collector(tmp_path / "spool") as collector:
        request = urllib.request.Request(collector.url, data=message.SerializeToString(), method="POST",
                                         headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        spans = collector.spans()
    assert [(s.service, s.name, s.trace_id) for s in spans] == [("gw", "gateway.queue", "ab" * 16)]
    assert spans[0].seconds == pytest.approx(0.030)
