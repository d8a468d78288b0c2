"""A FAKE OpenTelemetry collector for tests: OTLP/HTTP (protobuf) on a local port, keeping every span it is sent.

The gateway's exporter and vLLM's (`--otlp-traces-endpoint`, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`)
post `ExportTraceServiceRequest` messages to `/v1/traces`; each span is kept as a `Span` with its service.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    error: bool


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _spans(message: ExportTraceServiceRequest) -> Iterator[Span]:
    for resource_spans in message.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                yield Span(str(resource.get("service.name", "")), s.name, s.trace_id.hex(), s.span_id.hex(),
                           s.parent_span_id.hex(), s.kind, {a.key: _value(a.value) for a in s.attributes},
                           tuple(e.name for e in s.events), s.status.code == 2)


class Collector:
    """The spans received so far, and a wait for more."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.url = ""

    def wait_for(self, predicate: Any, timeout_s: float = 15.0) -> list[Span]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.05)
        return []


@contextmanager
def otlp_collector() -> Iterator[Collector]:
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            with collector.lock:
                collector.spans.extend(_spans(message))
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    collector.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield collector
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
