"""The gateway: routes, the error/auth boundary, and the lifecycle of the clients and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import math
import os
import random
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from urllib.parse import unquote

import aiohttp

from .admin import AdminApi, is_admin_path, relay
from .config import GatewayConfig
from .control import ControlPlane
from .discovery import Resolver
from .errors import GatewayError
from .fairqueue import PriorityOrder
from .health import HealthChecker
from .lora import AdapterRouter, SharedHoldings, VllmAdapterApi, upstream_headers
from .metrics import Metrics
from .parsing import not_found, other_info, parse
from .policies import make_policy
from .proxy import Proxy
from .ratelimit import TokenRates
from .replicaset import Follower
from .router import Router
from .server import Deadlines, HttpServer, Request, Responder, Response
from .settlement import Settlement
from .table import R_PID, R_STATE, STATE_READY, LoadTable
from .tenancy import Classifier
from .tokens import TokenCounter
from .tracing import Tracing, make_tracing
from .upstream import UpstreamPool

logger = logging.getLogger(__name__)

Route = Callable[[Request, Responder, str], Awaitable["Response | None"]]

_OWN_METHODS = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/embeddings": "POST",
                "/v1/models": "GET", "/health": "GET", "/ready": "GET", "/metrics": "GET"}
# vLLM's own API outside /v1, proxied as any /v1 path is (as production-stack's router does): token counts, pooling
# models' scores and ranks, the engine's version
_VLLM_PATHS = frozenset({"/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/v2/rerank",
                         "/version"})
_MODEL_PREFIX = "/v1/models/"  # one model's card: answered here, from the replicas' cards
# vLLM's runtime adapter API: a client must not load any path on a replica, nor unload what the gateway routes to
_REFUSED = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def _keyed(path: str) -> bool:
    """Whether the API keys guard `path`: the OpenAI API, and vLLM's own that the gateway proxies."""
    return path.startswith("/v1/") or path in _VLLM_PATHS


def _json(data: object, status: int = 200) -> Response:
    return Response(status, json.dumps(data).encode())


def error_response(exc: GatewayError) -> Response:
    return Response(exc.status, exc.encoded(), headers=exc.headers)


class Gateway:
    """The gateway's parts, built from one config; `handle` answers every request the server parses.

    One process (`table` None): it has a load table of its own and runs the control plane (health probes,
    discovery, load feedback) itself. A worker of N: it writes row `row` of the supervisor's table and follows the
    replica set the supervisor publishes there. The request path is the same code either way.
    """

    def __init__(self, config: GatewayConfig, resolver: Resolver | None = None,
                 rng: random.Random | None = None, *, table: LoadTable | None = None, row: int = 1,
                 admin_socket: str | None = None) -> None:
        self.config = config
        self._api_keys = tuple(key.encode() for key in config.api_keys)  # encoded once, compared per request
        self.tracing: Tracing | None = None
        # the admission queue's bound is the gateway's: each worker holds its share
        queue = replace(config.queue, max_size=math.ceil(config.queue.max_size / config.workers))
        models = config.model_map()
        # priorities and fairness (docs/priority.md): built only when configured, so that otherwise nothing runs
        ordered = config.priority.enabled or config.tenants.fair
        self.router = Router(
            make_policy(config.policy, rng), queue,
            model_policies={name: make_policy(m.policy, rng) for name, m in models.items() if m.policy},
            model_queues={name: replace(m.queue, max_size=math.ceil(m.queue.max_size / config.workers))
                          for name, m in models.items() if m.queue is not None},
            order=PriorityOrder(config.tenants.fair, config.queue.headroom, config.queue.headroom_idle_s)
            if ordered else None)
        self._classifier = (Classifier(config.priority, config.tenants)
                            if config.priority.enabled or config.tenants.enabled else None)
        rates = TokenRates(config.tenants, config.workers)
        self._rates = rates if rates.limited else None
        own = table is None
        self.table = table if table is not None else LoadTable.create(rows=2)
        self.row = row
        self._cards_changed = asyncio.Event()  # the replicas' model cards changed: look for tokenizers
        self.follower = Follower(self.table, row, self.router, self._cards_changed.set)
        self.control = (ControlPlane(config, self.table, range(1, 2), resolver, on_change=self.follower.sync)
                        if own else None)
        self.follower.sync()
        # the admin API acts on the control plane: here in one process, in the supervisor (a Unix socket) with N
        self._admin = AdminApi(self.control) if self.control is not None else None
        self._admin_socket = admin_socket
        self.metrics = Metrics(self.router, self.table, row, range(1, self.table.rows))
        self.counter = TokenCounter.from_sources(config.tokenizer_map())  # at start: never from a request
        self.adapters: AdapterRouter | None = None  # LoRA adapters on demand: made at start when configured
        self._lora_session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self._ids = random.Random(os.urandom(16))  # request ids: unique, not secret; no syscall per request
        self._pool: UpstreamPool | None = None
        self._tasks: list[asyncio.Task[None]] = []
        handlers: dict[str, Route] = {
            "/v1/completions": self._generation("completions"),
            "/v1/chat/completions": self._generation("chat"),
            "/v1/embeddings": self._generation("embeddings"),
            "/v1/models": self._models,
            "/health": self._health,
            "/ready": self._ready,
            "/metrics": self._metrics,
        }
        self._routes: dict[tuple[str, str], Route] = {}  # by (method, path): one lookup per well-formed request
        for path, handler in handlers.items():
            self._routes[(_OWN_METHODS[path], path)] = handler
            if _OWN_METHODS[path] == "GET":
                self._routes[("HEAD", path)] = handler

    # -- lifecycle --------------------------------------------------------------------------------------------
    @property
    def health(self) -> HealthChecker | None:
        """The health checker, in the process that runs the control plane."""
        return self.control.health if self.control is not None else None

    async def start(self) -> None:
        """Open the replica clients; start following the replica set (and, in one process, the control plane)."""
        if self.control is not None:
            await self.control.start()
        https = any(r.url.startswith("https:") for r in self.config.replicas) or any(
            d.scheme == "https" for d in self.config.discovery)
        # the CA bundle is read now, at start: a file opened on a request's path may find no descriptor left
        self._pool = UpstreamPool(self.config.timeouts.connect_s,
                                  ssl_context=ssl.create_default_context() if https else None)
        worker = str(os.getpid()) if self.config.workers > 1 else None
        # here, in the process that serves: the SDK's export thread does not survive a fork
        self.tracing = make_tracing(self.config.tracing, self.config.policy)
        self.proxy = Proxy(self.config, self.router, self._pool, self.metrics, worker, self.tracing,
                           Settlement.of(self.router.order, self._rates))
        self._tasks = [asyncio.create_task(self.follower.run(), name="replica-set-follower"),
                       asyncio.create_task(self._learn_tokenizers(), name="tokenizer-discovery")]
        if self.config.lora.enabled:
            self.adapters = self._adapter_router()
            self._tasks.append(asyncio.create_task(self.adapters.run(), name="lora-adapter-sync"))

    def _adapter_router(self) -> AdapterRouter:
        lora, timeouts = self.config.lora, self.config.timeouts
        self._lora_session = aiohttp.ClientSession()
        api = VllmAdapterApi(self._lora_session, max(lora.load_timeout_s, timeouts.connect_s),
                             upstream_headers(self.config))
        table = self.table
        holdings = SharedHoldings(self.metrics.store, lambda: [table.metric_region(r) for r in range(table.hi)])
        holdings.forget_inflight(self.router.replicas, [a.name for a in lora.adapters])
        return AdapterRouter(lora, self.router, self.router.policy, api, holdings, self.metrics.store)

    async def _learn_tokenizers(self) -> None:
        """Load the tokenizers of models whose cards name a local directory, as replicas report them."""
        while True:
            await self._cards_changed.wait()
            self._cards_changed.clear()
            cards = {m: c for r in list(self.router.replicas.values()) for m, c in r.cards.items()}
            await self.counter.discover(cards)

    def serving(self) -> None:
        """Mark this process's row as serving (the supervisor waits for it; /metrics counts it)."""
        self.table.cells[self.table.head_cell(self.row, R_PID)] = os.getpid()
        self.table.cells[self.table.head_cell(self.row, R_STATE)] = STATE_READY

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.router.close()
        if self.adapters is not None:
            await self.adapters.close()
        if self._lora_session is not None:
            await self._lora_session.close()
        if self.proxy is not None:
            self.proxy.close()
        if self._pool is not None:
            self._pool.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # the last spans' export, bounded by its timeout
        if self.control is not None:
            await self.control.stop()

    # -- the boundary -----------------------------------------------------------------------------------------
    async def handle(self, request: Request, responder: Responder) -> Response | None:
        """Request ids, API keys, routing, and every error as an OpenAI-style body with the right status."""
        request_id = request.headers.get("x-request-id") or f"{self._ids.getrandbits(128):032x}"
        responder.headers["x-request-id"] = request_id
        if "%" in request.path:  # route as the replica will: vLLM's server matches the decoded path
            request = replace(request, path=unquote(request.path))
        try:
            if self.config.api_keys and _keyed(request.path) and not self._authorized(request):
                raise GatewayError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                                   code="invalid_api_key")
            route = self._routes.get((request.method, request.path)) or self._elsewhere(request)
            return await route(request, responder, request_id)
        except GatewayError as exc:
            if exc.status in (401, 429) or exc.status >= 500:
                self.metrics.rejections.labels(f"status_{exc.status}").inc()
            return error_response(exc)

    def _elsewhere(self, request: Request) -> Route:
        """Any other /v1 path, the admin API, or a 405 for a wrong method on a path of the gateway's own, or a 404."""
        if self.config.admin_key and is_admin_path(request.path):
            return self._admin_api
        allowed = _OWN_METHODS.get(request.path.rstrip("/"))
        if allowed and request.method != allowed and not (allowed == "GET" and request.method == "HEAD"):
            raise GatewayError(405, f"{request.method} is not allowed on {request.path}; use {allowed}",
                               code="method_not_allowed", headers={"Allow": allowed})
        path = request.path
        if path.rstrip("/") in _REFUSED:
            raise GatewayError(403, f"{path} is not served to clients: adapters are loaded by the gateway, from the "
                               "names in its config (lora.adapters), when a request names one", code="forbidden")
        if path.startswith(_MODEL_PREFIX) and request.method in ("GET", "HEAD"):
            return self._model
        if not (path.startswith("/v1/") or path in _VLLM_PATHS):
            raise GatewayError(404, f"{request.method} {path}: Not Found", code="not_found")
        return self._other_v1

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        token = (header[7:] if header[:7].lower() == "bearer " else "").encode()
        return any([hmac.compare_digest(token, key) for key in self._api_keys])  # every key compared, always

    # -- routes -----------------------------------------------------------------------------------------------
    def _generation(self, endpoint: str) -> Route:
        async def handle(request: Request, responder: Responder, request_id: str) -> Response | None:
            adapters, classifier = self.adapters, self._classifier
            check = adapters.check_model if adapters is not None else self.router.check_model
            info = parse(request.body, endpoint, self.counter, self.config.default_max_tokens, check,
                         priority=classifier is not None)
            if classifier is not None:
                classified = classifier.classify(request, info)
                info = classified.info
                if classified.body is not request.body:
                    request = replace(request, body=classified.body)
                if self._rates is not None:
                    try:
                        self._rates.take(info)
                    except GatewayError:
                        self.metrics.rejections.labels("tenant_token_rate").inc()
                        raise
            placer = adapters if adapters is not None and info.model in adapters.registry else None
            assert self.proxy is not None
            return await self.proxy.forward(request, responder, info, request_id, placer)
        return handle

    async def _other_v1(self, request: Request, responder: Responder, request_id: str) -> Response | None:
        """Any other /v1 path, or vLLM's own (`_VLLM_PATHS`): to a replica serving the body's `model` when it names
        one, else to any."""
        assert self.proxy is not None
        return await self.proxy.forward(request, responder, other_info(request.body), request_id)

    async def _admin_api(self, request: Request, responder: Responder, request_id: str) -> Response:
        """/admin/replicas: answered here in one process, by the supervisor with N workers (gateway/admin.py)."""
        if self._admin is not None:
            return await self._admin.handle(request)
        if self._admin_socket is not None:
            return await relay(self._admin_socket, request)
        raise GatewayError(503, "the admin API is not available in this process", code="admin_unavailable")

    async def _models(self, request: Request, responder: Responder, request_id: str) -> Response:
        """The union of the healthy replicas' models."""
        return _json({"object": "list", "data": list(self._cards().values())})

    async def _model(self, request: Request, responder: Responder, request_id: str) -> Response:
        """/v1/models/{id}: one model's card, as OpenAI's API serves it (vLLM's own server has no such path)."""
        model = request.path[len(_MODEL_PREFIX):]
        if not model:
            return await self._models(request, responder, request_id)
        card = self._cards().get(model)
        if card is None:
            raise not_found(model)
        return _json(card)

    def _cards(self) -> dict[str, dict[str, object]]:
        cards: dict[str, dict[str, object]] = {}
        for replica in self.router.healthy():
            for model_id in sorted(replica.models):
                cards.setdefault(model_id, replica.cards.get(model_id) or {"id": model_id, "object": "model"})
        if self.adapters is not None:  # registered adapters are served, loaded or not
            for spec in self.adapters.registry.values():
                cards.setdefault(spec.name, {"id": spec.name, "object": "model", "owned_by": "smallserve",
                                             "root": spec.name, "parent": spec.base})
        return cards

    async def _health(self, request: Request, responder: Responder, request_id: str) -> Response:
        return _json({"status": "ok"})

    async def _ready(self, request: Request, responder: Responder, request_id: str) -> Response:
        healthy = [r.url for r in self.router.healthy()]
        return _json({"ready": bool(healthy), "healthy_replicas": healthy, "replicas": len(self.router.replicas)},
                     200 if healthy else 503)

    async def _metrics(self, request: Request, responder: Responder, request_id: str) -> Response:
        return Response(200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")


def freeze_startup_objects() -> None:
    """For a serving process, once it serves: move what is alive then (modules, the config, tokenizers: about 40,000
    objects) out of the collector's reach (`gc.freeze`), so that a full collection walks only what requests made.
    Under a flood of a thousand queued requests, full collections paused this gateway's loop for 21-42 ms every
    10 s or so (docs/priority.md). Not for a process that starts gateways again and again (tests): frozen objects
    are never freed."""
    gc.collect()
    gc.freeze()


@contextlib.asynccontextmanager
async def running(config: GatewayConfig, resolver: Resolver | None = None, rng: random.Random | None = None,
                  grace_s: float = 30.0, *, table: LoadTable | None = None, row: int = 1,
                  sock: socket.socket | None = None, admin_socket: str | None = None
                  ) -> AsyncIterator[tuple[Gateway, int]]:
    """The gateway serving on `config.host`:`config.port`, or on `sock` (the bound port is yielded: useful with 0)."""
    gateway = Gateway(config, resolver, rng, table=table, row=row, admin_socket=admin_socket)
    await gateway.start()
    clients = config.clients
    server = HttpServer(gateway.handle, config.max_body_bytes, clients.keepalive_s,
                        deadlines=Deadlines(clients.header_timeout_s, clients.body_timeout_s,
                                            clients.body_min_bytes_per_s, clients.send_timeout_s),
                        max_connections=clients.max_connections,
                        on_shed=gateway.metrics.connections_shed.labels("no_request_head").inc)
    try:
        port = await server.start(config.host, config.port, sock=sock)
        gateway.serving()
        yield gateway, port
    finally:
        await server.close(grace_s)
        await gateway.stop()
