"""Forward a request to a replica and relay the answer, streaming or not.

Before anything reaches the client, a refused connection, a 502/503, a timeout or a dropped connection is retried
on another replica, bounded in attempts and time. Once bytes have reached the client nothing is retried: a replica
that dies mid-stream gets the client a final SSE error event and a clean end of stream. A client that goes away
closes the upstream connection at once, so vLLM aborts the request and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from .config import GatewayConfig
from .errors import GatewayError
from .health import eject
from .metrics import Metrics
from .parsing import RequestInfo
from .replicas import Lease
from .router import Router

logger = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("request_id", str)
_SSE_EVENT = b"data:"
_UPSTREAM_ERRORS = (aiohttp.ClientError, ConnectionError, TimeoutError)
_RETRY_STATUSES = (502, 503)


@dataclass
class _Upstream:
    """A replica's answer so far: its head, and the first chunk (streaming) or the whole body."""

    response: aiohttp.ClientResponse
    first: bytes

    @property
    def streaming(self) -> bool:
        return self.response.status == 200 and self.response.content_type == "text/event-stream"


class _Retryable(Exception):
    """The replica failed before anything reached the client."""

    def __init__(self, reason: str, status: int, message: str, eject_reason: str = "answered 502/503") -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.eject_reason = eject_reason


def _retryable(exc: BaseException, url: str) -> _Retryable:
    """A failure before the first byte, as the retryable error it is (timeouts first: some are also ClientErrors)."""
    if isinstance(exc, _Retryable):
        return exc
    if isinstance(exc, TimeoutError):
        return _Retryable("timeout", 504, f"replica {url} timed out before the first byte",
                          "timed out before the first byte")
    return _Retryable("connection", 502, f"replica {url} failed: {exc}", repr(exc))


class Proxy:
    """Relays requests to the replicas the router picks."""

    def __init__(self, config: GatewayConfig, router: Router, session: aiohttp.ClientSession,
                 metrics: Metrics) -> None:
        self._config = config
        self._router = router
        self._session = session
        self._metrics = metrics
        self._headers = {"Content-Type": "application/json"}
        if config.upstream_api_key:
            self._headers["Authorization"] = f"Bearer {config.upstream_api_key}"

    async def forward(self, request: web.Request, raw: bytes, info: RequestInfo) -> web.StreamResponse:
        """Send `raw` to a replica (retrying on another while that is safe) and relay its answer."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self._config.retry.max_time_s
        tried: set[str] = set()
        attempts = self._config.retry.max_attempts
        for attempt in range(1, attempts + 1):
            lease = await self._router.acquire(info, frozenset(tried))
            try:
                upstream = await self._send(request, raw, lease, info)
            except _Retryable as exc:
                lease.release()
                tried.add(lease.replica.url)
                if attempt == attempts or loop.time() >= deadline:
                    self._metrics.rejections.labels(exc.reason).inc()
                    raise GatewayError(exc.status, f"{exc} (after {attempt} attempt(s))",
                                       code="upstream_error") from None
                self._metrics.retries.labels(exc.reason).inc()
                continue
            except BaseException:
                lease.release()
                raise
            try:
                return await self._relay(request, upstream, lease, info, started)
            finally:
                lease.release()
                upstream.response.close()
        raise AssertionError("unreachable: the loop returns or raises")

    async def _send(self, request: web.Request, raw: bytes, lease: Lease, info: RequestInfo) -> _Upstream:
        """The replica's head and first chunk (or whole body), within the first-byte timeout.

        Connecting is bounded by the session's `sock_connect` (timeouts.connect_s), set once in app.py.
        """
        replica = lease.replica
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self._config.timeouts.first_byte_s):
                response = await self._session.request(request.method, replica.url + request.path_qs,
                                                       data=raw or None, headers=self._headers)
                if response.status in _RETRY_STATUSES:
                    raise _Retryable(f"status_{response.status}", 502,
                                     f"replica {replica.url} answered {response.status}")
                if response.status == 200 and info.stream and response.content_type == "text/event-stream":
                    first = await response.content.readany()
                else:
                    first = await response.read()
        except (_Retryable, *_UPSTREAM_ERRORS) as exc:
            if response is not None:
                response.close()
            failure = _retryable(exc, replica.url)
            eject(replica, failure.eject_reason)
            raise failure from None
        if response.status >= 500:
            eject(replica, f"answered {response.status}")
        return _Upstream(response, first)

    def _head(self, request: web.Request, upstream: _Upstream, lease: Lease) -> dict[str, str]:
        return {
            "Content-Type": upstream.response.headers.get("Content-Type", "application/json"),
            "x-gateway-replica": lease.replica.url,
            "x-request-id": request[REQUEST_ID],
        }

    async def _relay(self, request: web.Request, upstream: _Upstream, lease: Lease, info: RequestInfo,
                     started: float) -> web.StreamResponse:
        status = upstream.response.status
        labels = (lease.replica.url, info.model)
        headers = self._head(request, upstream, lease)
        response: web.StreamResponse
        if not upstream.streaming:
            response = web.Response(body=upstream.first, status=status, headers=headers)
        else:
            response = await self._stream(request, upstream, lease, headers, started, labels)
        self._metrics.requests.labels(*labels, str(status)).inc()
        self._metrics.latency.labels(*labels).observe(asyncio.get_running_loop().time() - started)
        return response

    async def _stream(self, request: web.Request, upstream: _Upstream, lease: Lease, headers: dict[str, str],
                      started: float, labels: tuple[str, str]) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        response = web.StreamResponse(headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        data = upstream.first
        if data:
            self._metrics.ttft.labels(*labels).observe(loop.time() - started)
            lease.first_token()
        content = upstream.response.content
        watch = _IdleWatch(loop, self._config.timeouts.idle_s)
        failure = ""
        try:
            while data:
                lease.tokens(data.count(_SSE_EVENT))
                await response.write(data)
                data = await content.readany()
                watch.last = loop.time()
        except asyncio.CancelledError:
            if not watch.expired:
                raise  # the client went away (handler cancellation) or the server is stopping
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            failure = f"stalled for {self._config.timeouts.idle_s:g} s"
        except (*_UPSTREAM_ERRORS, asyncio.IncompleteReadError) as exc:
            if request.transport is None or request.transport.is_closing():
                logger.debug("client went away mid-stream from %s", lease.replica.url)
                return response
            failure = f"failed: {exc!r}"
        finally:
            watch.close()
        try:
            if failure:
                eject(lease.replica, f"stream {failure}")
                error = GatewayError(502, f"the replica serving this stream {failure}; the response is incomplete",
                                     code="upstream_stream_error")
                await response.write(error.sse_event())
            await response.write_eof()
        except ConnectionResetError:
            logger.debug("client went away at the end of a stream from %s", lease.replica.url)
        return response


class _IdleWatch:
    """Cancels the current task when `last` is older than `idle_s`.

    One timestamp per chunk instead of re-arming a timer per chunk (asyncio.timeout's reschedule cost about a
    tenth of the gateway's CPU on paced streams, measured with py-spy).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self._loop = loop
        self._idle_s = idle_s
        self._task = asyncio.current_task()
        self.last = loop.time()
        self.expired = False
        self._handle = loop.call_at(self.last + idle_s, self._check)

    def _check(self) -> None:
        deadline = self.last + self._idle_s
        if self._loop.time() < deadline:
            self._handle = self._loop.call_at(deadline, self._check)
        elif self._task is not None:
            self.expired = True
            self._task.cancel()

    def close(self) -> None:
        self._handle.cancel()
