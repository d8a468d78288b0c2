"""Trace context across the gateway, and OpenTelemetry spans of each request's way through it.

W3C trace context (`traceparent`, `tracestate`) sent by a client is checked (a malformed one is a 400) and passed on
to the replica. With `tracing: {endpoint: ...}` configured, the gateway also records spans and exports them over
OTLP; vLLM started with `--otlp-traces-endpoint` then records its `llm_request` span as a child of the attempt that
reached it, so one trace runs client → gateway → engine:

    gateway.request     SERVER: the client's span as parent (or a new trace); model, stream, status, TTFT
     ├── gateway.pick   one per attempt: the policy, the replica, its estimated TTFT and load right after the pick
     │    └── gateway.queue     only when the request waited in the admission queue for a replica with room
     └── gateway.upstream       CLIENT, one per attempt: the replica, the attempt, its status or why it was retried,
          │                     and an event at the first byte
          └── llm_request       vLLM's span (its own export)

Sampling is decided once per request (parent-based: a client's sampled flag is followed; else `sampling_ratio` of
new traces): an unsampled request records nothing and only passes on a traceparent with the sampled flag off.
Tracing off (the default), the gateway records nothing and passes the client's headers on as they came.
The OpenTelemetry SDK and its OTLP exporter are imported only when tracing is on (the `tracing` extra).
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .config import TracingConfig
from .errors import GatewayError
from .parsing import RequestInfo
from .policies import EstimatedTtft
from .replicas import Lease

if TYPE_CHECKING:
    from .server import Request

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")
_TRACESTATE = re.compile(r"[\x20-\x7e]{0,512}")  # W3C: at most 32 list members, printable ASCII


@dataclass(frozen=True)
class TraceContext:
    """A client's trace context, as sent (the headers) and as numbers (for the spans' parent)."""

    traceparent: str
    tracestate: str
    trace_id: int
    span_id: int
    sampled: bool

    def header_bytes(self) -> bytes:
        return trace_headers(self.traceparent, self.tracestate)


def trace_headers(traceparent: str, tracestate: str = "") -> bytes:
    """The header lines that carry a trace context to the replica (tracestate only when there is one)."""
    state = f"tracestate: {tracestate}\r\n" if tracestate else ""
    return f"traceparent: {traceparent}\r\n{state}".encode("latin-1")


def incoming(headers: dict[str, str]) -> TraceContext | None:
    """The request's trace context; None without one; 400 for a malformed one (the client would lose its trace)."""
    traceparent = headers.get("traceparent")
    if traceparent is None:
        return None
    match = _TRACEPARENT.fullmatch(traceparent)
    if (match is None or match[1] == "ff" or (match[1] == "00" and match[5]) or not int(match[2], 16)
            or not int(match[3], 16)):
        raise GatewayError(400, f"traceparent {traceparent[:80]!r} is not a W3C trace context: "
                                "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, lower case, ids not all zero",
                           param="traceparent", code="invalid_traceparent")
    tracestate = headers.get("tracestate", "")
    if not _TRACESTATE.fullmatch(tracestate) or tracestate.count(",") > 31:
        raise GatewayError(400, "tracestate must be printable ASCII, at most 512 characters and 32 members",
                           param="tracestate", code="invalid_tracestate")
    return TraceContext(traceparent, tracestate, int(match[2], 16), int(match[3], 16), bool(int(match[4], 16) & 1))


class RequestTrace(Protocol):
    """What the proxy tells a request's trace; `attempt` gives the trace headers for that attempt's replica."""

    def queued(self) -> None: ...
    def picked(self, lease: Lease) -> None: ...
    def attempt(self, lease: Lease, number: int) -> bytes: ...
    def first_byte(self) -> None: ...
    def attempt_failed(self, reason: str, status: int) -> None: ...
    def finish(self, status: int, error: str = "") -> None: ...


class Untraced:
    """A request the gateway does not record: its client's trace headers (if any) go to the replica unchanged."""

    __slots__ = ("_headers",)

    def __init__(self, headers: bytes = b"") -> None:
        self._headers = headers

    def queued(self) -> None:
        return None

    def picked(self, lease: Lease) -> None:
        return None

    def attempt(self, lease: Lease, number: int) -> bytes:
        return self._headers

    def first_byte(self) -> None:
        return None

    def attempt_failed(self, reason: str, status: int) -> None:
        return None

    def finish(self, status: int, error: str = "") -> None:
        return None


class Tracing(Protocol):
    """Makes each request's trace; `close` flushes what is left to export."""

    def start(self, request: Request, info: RequestInfo) -> RequestTrace: ...
    def close(self) -> None: ...


class PassThrough:
    """Tracing off: a valid client trace context goes on to the replica as it came; nothing is recorded."""

    def __init__(self) -> None:
        self._none = Untraced()

    def start(self, request: Request, info: RequestInfo) -> RequestTrace:
        context = incoming(request.headers) if "traceparent" in request.headers else None
        return self._none if context is None else Untraced(context.header_bytes())

    def close(self) -> None:
        return None


class OtelTracing:
    """Tracing on: spans through the OpenTelemetry SDK, exported in batches by its background thread."""

    def __init__(self, config: TracingConfig, policy: str) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise RuntimeError("tracing needs the OpenTelemetry SDK: pip install 'smallserve[tracing]'") from exc
        self.trace = trace
        self._ratio = config.sampling_ratio
        self._rng = random.Random(os.urandom(16))  # sampling and unsampled ids: no system call per request
        self._provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
        self.tracer = self._provider.get_tracer("smallserve.gateway")
        self.policy = policy

    def start(self, request: Request, info: RequestInfo) -> RequestTrace:
        client = incoming(request.headers) if "traceparent" in request.headers else None
        sampled = client.sampled if client is not None else self._rng.random() < self._ratio
        if not sampled:  # the client's decision or the ratio's: the replica is told "not sampled" too
            return Untraced(client.header_bytes() if client is not None else trace_headers(
                f"00-{self._rng.getrandbits(128) or 1:032x}-{self._rng.getrandbits(64) or 1:016x}-00"))
        trace = self.trace
        parent = None if client is None else trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
            client.trace_id, client.span_id, is_remote=True, trace_flags=trace.TraceFlags(1))))
        span = self.tracer.start_span("gateway.request", context=parent, kind=trace.SpanKind.SERVER, attributes={
            "http.request.method": request.method, "url.path": request.path, "gen_ai.request.model": info.model,
            "gen_ai.request.max_tokens": info.max_tokens, "gateway.prompt_tokens": info.prompt_tokens,
            "gateway.stream": info.stream})
        return SpanTrace(self, span, client.tracestate if client is not None else "")

    def in_context(self, span: Any) -> Any:
        return self.trace.set_span_in_context(span)

    def close(self) -> None:
        self._provider.shutdown()  # flushes the batch (bounded by the exporter's timeout)


def _exporter(config: TracingConfig) -> Any:
    assert config.endpoint is not None
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        return Grpc(endpoint=config.endpoint, insecure=not config.endpoint.startswith("https:"),
                    timeout=config.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    return Http(endpoint=config.endpoint, timeout=config.timeout_s)


class SpanTrace:
    """One sampled request's spans; `finish` ends whichever are still open."""

    def __init__(self, tracing: OtelTracing, span: Any, tracestate: str) -> None:
        self._t = tracing
        self._span = span
        self._context = tracing.in_context(span)
        self._tracestate = tracestate
        self._started = time.monotonic()
        self._pick: Any = None
        self._queue: Any = None
        self._upstream: Any = None

    def _start_pick(self) -> None:
        if self._pick is None:
            self._pick = self._t.tracer.start_span("gateway.pick", context=self._context,
                                                    attributes={"gateway.policy": self._t.policy})

    def queued(self) -> None:
        self._start_pick()
        self._queue = self._t.tracer.start_span("gateway.queue", context=self._t.in_context(self._pick))

    def picked(self, lease: Lease) -> None:
        self._start_pick()
        if self._queue is not None:
            self._queue.end()
            self._queue = None
        replica = lease.replica
        self._pick.set_attributes({
            "gateway.replica": replica.url, "gateway.replica.inflight": replica.inflight,
            "gateway.replica.outstanding_tokens": replica.outstanding,
            "gateway.replica.estimated_ttft_s": EstimatedTtft.estimate(replica, 0)})
        self._pick.end()
        self._pick = None

    def attempt(self, lease: Lease, number: int) -> bytes:
        self._upstream = span = self._t.tracer.start_span(
            "gateway.upstream", context=self._context, kind=self._t.trace.SpanKind.CLIENT,
            attributes={"gateway.replica": lease.replica.url, "gateway.attempt": number})
        ctx = span.get_span_context()
        return trace_headers(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}",
                             self._tracestate)

    def first_byte(self) -> None:
        if self._upstream is not None:
            self._upstream.add_event("first byte")
        self._span.set_attribute("gen_ai.latency.time_to_first_token", time.monotonic() - self._started)

    def attempt_failed(self, reason: str, status: int) -> None:
        if self._upstream is not None:
            self._upstream.set_attributes({"gateway.retry_reason": reason, "http.response.status_code": status})
            self._error(self._upstream, reason)
            self._upstream.end()
            self._upstream = None

    def finish(self, status: int, error: str = "") -> None:
        for span in (self._queue, self._pick):
            if span is not None:
                span.end()
        if self._upstream is not None:
            self._upstream.set_attribute("http.response.status_code", status)
            if error:
                self._error(self._upstream, error)
            self._upstream.end()
        self._span.set_attribute("http.response.status_code", status)
        if error or status >= 500:
            self._error(self._span, error or f"status {status}")
        self._span.end()

    def _error(self, span: Any, description: str) -> None:
        trace = self._t.trace
        span.set_status(trace.Status(trace.StatusCode.ERROR, description))


def make_tracing(config: TracingConfig, policy: str) -> Tracing:
    """Spans when an endpoint is configured; else client trace context passed through."""
    if config.endpoint:
        return OtelTracing(config, policy)
    return PassThrough()
