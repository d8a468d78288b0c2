"""The aiohttp application: routes, the error/auth boundary, and the lifecycle of the session and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from .config import GatewayConfig
from .discovery import DnsDiscovery, Resolver, SystemResolver
from .errors import GatewayError
from .health import HealthChecker
from .metrics import Metrics
from .parsing import other_info, parse
from .policies import make_policy
from .proxy import REQUEST_ID, Proxy
from .router import Router
from .tokens import TokenCounter

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    """The gateway's parts, built from one config."""

    def __init__(self, config: GatewayConfig, resolver: Resolver | None = None,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.router = Router(make_policy(config.policy, rng), config.queue, config.replicas)
        self.metrics = Metrics(self.router)
        self.counter = TokenCounter(config.tokenizer_map())
        self.resolver = resolver or SystemResolver()
        self.proxy: Proxy | None = None
        self.health: HealthChecker | None = None
        self.discovery = [DnsDiscovery(self.router, d, self.resolver) for d in config.discovery]


GATEWAY = web.AppKey("gateway", Gateway)


def _gateway(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


async def _read(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[GATEWAY].config.max_body_bytes
        raise GatewayError(413, f"the request body is larger than {limit} bytes",
                           code="request_too_large") from None


def _generation(endpoint: str) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        gw = _gateway(request)
        raw = await _read(request)
        info = parse(raw, endpoint, gw.counter, gw.config.default_max_tokens)
        assert gw.proxy is not None
        return await gw.proxy.forward(request, raw, info)
    return handle


_OWN_METHODS = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/embeddings": "POST",
                "/v1/models": "GET"}


async def other_v1(request: web.Request) -> web.StreamResponse:
    """Any other /v1 path: to a replica serving the body's `model` when it names one, else to any."""
    allowed = _OWN_METHODS.get(request.path.rstrip("/"))
    if allowed:
        raise GatewayError(405, f"{request.method} is not allowed on {request.path}; use {allowed}",
                           code="method_not_allowed", headers={"Allow": allowed})
    gw = _gateway(request)
    raw = await _read(request)
    assert gw.proxy is not None
    return await gw.proxy.forward(request, raw, other_info(raw))


async def models(request: web.Request) -> web.Response:
    """The union of the healthy replicas' models."""
    cards: dict[str, dict[str, object]] = {}
    for replica in _gateway(request).router.healthy():
        for model_id in sorted(replica.models):
            cards.setdefault(model_id, replica.cards.get(model_id) or {"id": model_id, "object": "model"})
    return web.json_response({"object": "list", "data": list(cards.values())})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    router = _gateway(request).router
    healthy = [r.url for r in router.healthy()]
    status = 200 if healthy else 503
    return web.json_response({"ready": bool(healthy), "healthy_replicas": healthy,
                              "replicas": len(router.replicas)}, status=status)


async def metrics(request: web.Request) -> web.Response:
    body = _gateway(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _authorized(request: web.Request, keys: tuple[str, ...]) -> bool:
    header = request.headers.get("Authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else ""
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


@web.middleware
async def boundary(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request ids, API keys, and every error turned into an OpenAI-style body with the right status."""
    request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
    request[REQUEST_ID] = request_id
    gw = request.app[GATEWAY]
    try:
        if gw.config.api_keys and request.path.startswith("/v1/") and not _authorized(request, gw.config.api_keys):
            raise GatewayError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                               code="invalid_api_key")
        response = await handler(request)
    except GatewayError as exc:
        response = exc.response()
        if exc.status in (401, 429) or exc.status >= 500:
            gw.metrics.rejections.labels(f"status_{exc.status}").inc()
    except web.HTTPException as exc:  # the router's 404 and 405, aiohttp's own 4xx
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        response = GatewayError(exc.status, message, code=exc.reason.lower().replace(" ", "_"),
                                headers={k: v for k, v in exc.headers.items() if k == "Allow"}).response()
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    return response


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """One pooled client session and the background tasks, created at start and closed at stop."""
    gw = app[GATEWAY]
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=False)
    # Connecting is bounded here; the proxy bounds the first byte and the gaps between chunks itself, and the
    # health checker passes its own total timeout.
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=gw.config.timeouts.connect_s,
                                                                  sock_read=None))
    gw.proxy = Proxy(gw.config, gw.router, session, gw.metrics)
    probe_headers = {"Authorization": f"Bearer {gw.config.upstream_api_key}"} if gw.config.upstream_api_key else {}
    gw.health = HealthChecker(gw.router, session, gw.config.health, probe_headers)
    tasks = [asyncio.create_task(d.run(), name="dns-discovery") for d in gw.discovery]
    tasks.append(asyncio.create_task(gw.health.run(), name="health-checks"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await session.close()


def make_app(config: GatewayConfig, resolver: Resolver | None = None,
             rng: random.Random | None = None) -> web.Application:
    """The gateway as an aiohttp application."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[boundary])
    app[GATEWAY] = Gateway(config, resolver, rng)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/completions", _generation("completions"))
    app.router.add_post("/v1/chat/completions", _generation("chat"))
    app.router.add_post("/v1/embeddings", _generation("embeddings"))
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/v1/{tail:.*}", other_v1)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app
