"""A FAKE OpenTelemetry collector, for tests and benchmarks: OTLP/HTTP (protobuf) on a local port, keeping every
span it is sent.

The gateway's exporter and vLLM's (`--otlp-traces-endpoint`, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`)
post `ExportTraceServiceRequest` messages to `/v1/traces`; each span is kept as a `Span` with its service.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from deploy.ports import free_ports
from deploy.process import probe


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
    start_ns: int = 0  # Unix epoch nanoseconds
    end_ns: int = 0

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


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
                           tuple(e.name for e in s.events), s.status.code == 2, s.start_time_unix_nano,
                           s.end_time_unix_nano)


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


def _answer_export(handler: BaseHTTPRequestHandler) -> None:
    """The OTLP/HTTP answer to an export: 200, an empty `ExportTraceServiceResponse`."""
    reply = ExportTraceServiceResponse().SerializeToString()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/x-protobuf")
    handler.send_header("Content-Length", str(len(reply)))
    handler.end_headers()
    handler.wfile.write(reply)


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
            _answer_export(self)

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


class SpoolCollector:
    """Spans spooled to files by `spooling_collector`'s own process, read afterwards."""

    def __init__(self, directory: Path, url: str) -> None:
        self.directory = directory
        self.url = url

    def spans(self) -> list[Span]:
        """Every span of every export received so far."""
        spans: list[Span] = []
        for path in sorted(self.directory.glob("*.pb")):
            message = ExportTraceServiceRequest()
            message.ParseFromString(path.read_bytes())
            spans.extend(_spans(message))
        return spans


@contextmanager
def spooling_collector(directory: Path, startup_timeout_s: float = 30.0) -> Iterator[SpoolCollector]:
    """An OTLP/HTTP receiver in a process of its own that only writes each export's body to a file in `directory`:
    a benchmark that times requests does not parse spans in its own process while it measures (not measured: a
    precaution; the clusters it was first suspected of stayed without it, docs/priority.md). Stopped on leaving."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_ports()
    process = subprocess.Popen([sys.executable, "-m", "bench.otlp_collector", "--spool", str(directory),
                                "--port", str(port)], cwd=Path(__file__).resolve().parent.parent)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not probe(f"http://127.0.0.1:{port}/", 1.0):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the spooling collector did not start (exit {process.poll()})")
            time.sleep(0.1)
        yield SpoolCollector(directory, f"http://127.0.0.1:{port}/v1/traces")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve_spool(directory: Path, port: int) -> None:
    """Answer OTLP/HTTP exports on `port`, writing each body to `directory` as it comes (GET /: 200, for readiness)."""
    count = itertools.count()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            name = f"{next(count):08d}.pb"
            (directory / (name + ".part")).write_bytes(body)
            (directory / (name + ".part")).rename(directory / name)
            _answer_export(self)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    with ThreadingHTTPServer(("127.0.0.1", port), Handler) as server:
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
        server.serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="An OTLP/HTTP receiver that spools each export to a file.")
    parser.add_argument("--spool", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    arguments = parser.parse_args()
    serve_spool(arguments.spool, arguments.port)
