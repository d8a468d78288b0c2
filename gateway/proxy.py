"""Forward a request to a replica and relay the answer, streaming or not.

Before anything reaches the client, a refused connection, a 502/503, a timeout or a dropped connection is retried
on another replica, bounded in attempts and time. Once bytes have reached the client nothing is retried: a replica
that dies mid-stream gets the client a final SSE error event and a clean end of stream. A client that goes away
cancels the handler (server.py), which closes the upstream connection at once, so vLLM aborts the request and frees
its KV cache.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from .config import GatewayConfig
from .errors import GatewayError, overloaded, upstream_error
from .health import eject
from .limits import OUT_OF_DESCRIPTORS, Throttled
from .metrics import Metrics
from .parsing import RequestInfo
from .replicas import Lease
from .router import Router
from .server import Request, Responder, Response
from .settlement import Settlement, completion_tokens
from .tracing import PassThrough, RequestTrace, Tracing
from .upstream import TALLY_EVERY, Origin, UpstreamPool, UpstreamResponse
from .watchdogs import Watch, Watchdogs

logger = logging.getLogger(__name__)


class Adapters(Protocol):
    """Leases for a LoRA adapter's requests (gateway/lora.py's AdapterRouter)."""

    async def acquire(self, info: RequestInfo, exclude: frozenset[str]) -> Lease: ...

    def lost(self, url: str, name: str) -> None: ...


_SSE_EVENT = b"data:"
_RETRY_STATUSES = (502, 503)
_ADAPTER_MISSING = "adapter_missing"  # a replica answered 404 for an adapter the gateway counted as loaded there
_MAX_HELD = 64 * 1024  # an SSE event longer than this is relayed in parts


class _Retryable(Exception):
    """The replica failed before anything reached the client."""

    def __init__(self, reason: str, status: int, message: str,
                 eject_reason: str | None = "answered 502/503") -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.eject_reason = eject_reason  # None: the replica is not at fault


def _timed_out(url: str) -> _Retryable:
    return _Retryable("timeout", 504, f"replica {url} timed out before the first byte", "timed out before the first byte")


def _retryable(exc: BaseException, url: str) -> _Retryable:
    """A failure before the first byte, as the retryable error it is (timeouts first: they are also OSErrors)."""
    if isinstance(exc, _Retryable):
        return exc
    if isinstance(exc, TimeoutError):
        return _timed_out(url)
    return _Retryable("connection", 502, f"replica {url} failed: {exc!r}", repr(exc))


def _streams(response: UpstreamResponse, info: RequestInfo) -> bool:
    """Whether the answer is relayed as a stream: an SSE answer to a request that asked for one."""
    return response.status == 200 and info.stream and response.content_type == "text/event-stream"


class Proxy:
    """Relays requests to the replicas the router picks."""

    def __init__(self, config: GatewayConfig, router: Router, pool: UpstreamPool, metrics: Metrics,
                 worker: str | None = None, tracing: Tracing | None = None,
                 settlement: Settlement | None = None) -> None:
        self._config = config
        self._settlement = settlement  # tenants charged by tokens served (fairness, token rates), else None
        self._tracing = tracing or PassThrough()
        self._worker = worker  # with several workers, answers say which one served them (x-gateway-worker)
        self._router = router
        self._pool = pool
        self._metrics = metrics
        self._origins: dict[str, Origin] = {}
        self._out_of_descriptors = Throttled(logger)
        self._loop = asyncio.get_running_loop()  # once: each lookup is a getpid() system call on Python 3.11
        timeouts = config.timeouts
        tick_s = max(0.01, min(1.0, timeouts.first_byte_s / 10, timeouts.idle_s / 10))
        self._watchdogs = Watchdogs(self._loop, tick_s)
        self._headers = b"Content-Type: application/json\r\n"
        if config.upstream_api_key:
            self._headers += f"Authorization: Bearer {config.upstream_api_key}\r\n".encode("latin-1")

    async def forward(self, request: Request, responder: Responder, info: RequestInfo,
                      request_id: str, adapters: Adapters | None = None) -> Response | None:
        """Send the body to a replica (retrying on another while that is safe) and relay its answer.

        `adapters` takes the lease instead of the router (a LoRA adapter's requests: gateway/lora.py). A replica
        that answers 404 for the adapter no longer holds it (restarted since the gateway last read its list): the
        request is retried once the adapter is loaded again, on that replica or the best.
        """
        loop = self._loop
        started = loop.time()
        deadline = started + self._config.retry.max_time_s
        tried: frozenset[str] = frozenset()
        attempts = self._config.retry.max_attempts
        settlement = self._settlement
        try:
            trace = self._tracing.start(request, info)  # a malformed traceparent is a 400 here
        except GatewayError:
            if settlement is not None:
                settlement.request_done(info, None)
            raise
        status, error = 200, ""
        served: int | None = None  # output tokens of the replica's answer; None while none came
        try:
            for attempt in range(1, attempts + 1):
                lease = self._router.lease_now(info, tried) if adapters is None else None
                if lease is None:  # waiting for a replica with room (a LoRA adapter: for its replica and load)
                    trace.queued()
                    lease = await (self._router if adapters is None else adapters).acquire(info, tried)
                trace.picked(lease)
                watch = self._watchdogs.watch(self._config.timeouts.first_byte_s)
                upstream: UpstreamResponse | None = None
                answer: bytes | None = None  # set once the answer is being relayed: its first chunk, or whole
                streams = False
                try:
                    upstream, first, streams = await self._send(request, lease, info, request_id, watch,
                                                                trace.attempt(lease, attempt), adapters is not None)
                    status = upstream.status
                    trace.first_byte()
                    answer = first
                    return await self._relay(responder, upstream, first, streams, lease, info, started, watch)
                except _Retryable as exc:
                    trace.attempt_failed(exc.reason, exc.status)
                    if exc.reason == _ADAPTER_MISSING and adapters is not None:
                        adapters.lost(lease.replica.url, info.model)
                    else:
                        tried = tried | {lease.replica.url}
                    if attempt == attempts or loop.time() >= deadline:
                        self._metrics.rejections.labels(exc.reason).inc()
                        raise GatewayError(exc.status, f"{exc} (after {attempt} attempt(s))",
                                           code="upstream_error") from None
                    self._metrics.retries.labels(exc.reason).inc()
                finally:
                    self._watchdogs.done(watch)
                    lease.release()
                    if upstream is not None:
                        upstream.close()
                    if settlement is not None:
                        served = None if answer is None else _served(status, streams, answer, lease, info)
                        if lease.charged:
                            settlement.lease_done(info, served)
            raise AssertionError("unreachable: the loop returns or raises")
        except GatewayError as exc:
            status, error = exc.status, exc.message
            raise
        except asyncio.CancelledError:
            status, error = 499, "the client went away"
            raise
        finally:
            trace.finish(status, error)
            if settlement is not None:
                settlement.request_done(info, served)

    def close(self) -> None:
        self._watchdogs.close()

    def _origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin.from_url(url)
        return origin

    async def _send(self, request: Request, lease: Lease, info: RequestInfo, request_id: str,
                    watch: Watch, trace_headers: bytes, adapter: bool) -> tuple[UpstreamResponse, bytes, bool]:
        """The replica's answer, its first chunk (or whole body) within the first-byte timeout, and whether it is
        relayed as a stream. For a LoRA `adapter`'s request, a 404 is the replica's loss, not the client's."""
        replica = lease.replica
        origin = self._origin(replica.url)
        head = b"%b %b HTTP/1.1\r\nHost: %b\r\nContent-Length: %d\r\nX-Request-Id: %b\r\n%b%b\r\n" % (
            request.method.encode("latin-1"), request.target.encode("latin-1"), origin.host_header,
            len(request.body), request_id.encode("latin-1"), self._headers, trace_headers)
        response: UpstreamResponse | None = None
        try:
            response = await self._pool.request(origin, head, request.body)
            if response.status in _RETRY_STATUSES:
                raise _Retryable(f"status_{response.status}", 502, f"replica {replica.url} answered {response.status}")
            if adapter and response.status == 404:
                raise _Retryable(_ADAPTER_MISSING, 502, f"replica {replica.url} no longer holds adapter "
                                 f"`{info.model}`", eject_reason=None)
            streams = _streams(response, info)
            if streams:
                first = await response.readany()
            else:
                first = await response.read()
        except BaseException as exc:
            if response is not None:
                response.close()  # also when the client went away: the replica sees the request aborted
            failure: BaseException = exc
            if isinstance(exc, asyncio.CancelledError):
                if not self._watchdogs.timed_out(watch):
                    raise  # the client went away, or the gateway is stopping
                failure = TimeoutError()
            elif isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
                # the gateway's own shortage: neither the replica's fault (no ejection) nor helped by a retry
                self._out_of_descriptors.warning("out of file descriptors connecting to %s: %s", replica.url, exc)
                raise overloaded("the gateway is out of file descriptors; retry shortly") from None
            elif not isinstance(exc, (_Retryable, OSError)):
                raise
            retryable = _retryable(failure, replica.url)
            if retryable.eject_reason is not None:
                eject(replica, retryable.eject_reason)
            raise retryable from None
        if response.status >= 500:
            eject(replica, f"answered {response.status}")
        return response, first, streams

    async def _relay(self, responder: Responder, upstream: UpstreamResponse, first: bytes, streams: bool,
                     lease: Lease, info: RequestInfo, started: float, watch: Watch) -> Response | None:
        status = upstream.status
        content_type = upstream.headers.get("content-type", "application/json")
        headers = {"x-gateway-replica": lease.replica.url}
        if self._worker is not None:
            headers["x-gateway-worker"] = self._worker
        response: Response | None = None
        if streams:
            responder.start(status, headers, content_type)
            await self._stream(responder, upstream, first, lease, info, started, watch)
        else:
            rewritten = upstream_error(status, first) if 400 <= status < 500 and first else None
            if rewritten is not None:  # the client's mistake, told as OpenAI tells it, whatever the replica said
                first, content_type = rewritten, "application/json"
            response = Response(status, first, content_type, headers)
        self._metrics.answered(lease.replica.url, info.model, status, self._loop.time() - started)
        return response

    def _all_tokens(self, lease: Lease, data: bytes) -> None:
        """The whole answer is in, its last part `data`: the lease's output budget comes back without counting its
        events (10 KB: 6 us), unless a tenant is charged by the tokens served."""
        if self._settlement is not None:
            lease.tokens(data.count(_SSE_EVENT))
        lease.all_tokens()

    async def _stream(self, responder: Responder, upstream: UpstreamResponse, data: bytes, lease: Lease,
                      info: RequestInfo, started: float, watch: Watch) -> None:
        loop = self._loop
        if data:
            self._metrics.first_token(lease.replica.url, info.model, loop.time() - started)
            lease.first_token()
            if upstream.ended:  # the whole answer came with its head (tokens made back to back): one write
                self._all_tokens(lease, data)
                try:
                    await responder.send(data, last=True)
                except ConnectionError:
                    logger.debug("client went away before a stream from %s", lease.replica.url)
                return
        self._watchdogs.rearm(watch, self._config.timeouts.idle_s)
        failure = ""
        held = b""  # the start of an event still arriving: relayed once whole, so an error event never joins it

        send_now, tokens = responder.send_now, lease.tokens  # bound once: called once per token
        relayed = 0  # events relayed by relay_now and not yet counted down on the lease

        def relay_now(part: bytes, events: int) -> bool:
            """Whole events, straight to a client that keeps up, from the replica connection's callback."""
            nonlocal relayed
            if held or not part.endswith(b"\n\n") or not send_now(part):
                return False  # queued for the loop below, which waits for the client or completes the event
            relayed += events
            if relayed >= TALLY_EVERY:
                tokens(relayed)
                relayed = 0
            watch.moved += 1
            return True

        # Once the head has gone, a read of one whole chunk (a token, usually) goes straight to the client as the
        # replica framed it (relay_to): the connection counts those reads, tallied on the lease TALLY_EVERY at a
        # time and seen by the watchdog.
        upstream.splice(relay_now, tokens)
        watch.source = upstream
        direct = False  # reads of one whole chunk written straight to the client, once its head has gone
        try:
            while data:
                if held or not data.endswith(b"\n\n"):
                    data, held = _whole_events(held + data)
                if data:
                    last = not held and upstream.ended
                    if last:
                        self._all_tokens(lease, data)
                    else:
                        lease.tokens(data.count(_SSE_EVENT))
                    watch.paused = True  # a slow client is not a stalled replica
                    await responder.send(data, last=last)
                    watch.paused = False
                    if not direct and (target := responder.chunked_target()) is not None:
                        upstream.relay_to(target)
                        direct = True
                data = await upstream.readany()
                watch.last = loop.time()
            if held:
                await responder.send(held)  # the replica ended without ending its last event: relayed as sent
        except asyncio.CancelledError:
            if not self._watchdogs.timed_out(watch):
                raise  # the client went away, or the gateway is stopping
            failure = f"stalled for {self._config.timeouts.idle_s:g} s"
        except OSError as exc:
            if responder.client_gone:
                logger.debug("client went away mid-stream from %s", lease.replica.url)
                return
            failure = f"failed: {exc!r}"
        finally:
            upstream.splice(None)  # nothing more reaches the client behind this loop's back
            relayed += upstream.relayed % TALLY_EVERY  # those not yet tallied
            if relayed:
                lease.tokens(relayed)
        self._watchdogs.done(watch)
        try:
            if failure:
                eject(lease.replica, f"stream {failure}")
                error = GatewayError(502, f"the replica serving this stream {failure}; the response is incomplete",
                                     code="upstream_stream_error")
                await responder.send(error.sse_event())
            await responder.finish()
        except ConnectionError:
            logger.debug("client went away at the end of a stream from %s", lease.replica.url)


def _served(status: int, streams: bool, answer: bytes, lease: Lease, info: RequestInfo) -> int | None:
    """Output tokens a replica's answer held: a stream's events as counted; a whole answer's `usage` (the whole
    budget where it has none); None for an error answer (nothing served)."""
    if streams:
        return lease.counted
    if status != 200:
        return None
    tokens = completion_tokens(answer)
    return info.max_tokens if tokens is None else tokens


def _whole_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` up to the end of its last whole SSE event, and the rest (relayed as is past `_MAX_HELD` bytes)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    if len(data) - end > _MAX_HELD:
        return data, b""
    return data[:end], data[end:]
