"""The admin API: replicas listed, added, changed, removed and drained while the gateway runs.

    GET    /admin/replicas               every replica: id, URL, weight, caps, health, draining, load
    POST   /admin/replicas               add one: {"url", "name"?, "weight"?, "max_requests"?,
                                         "max_outstanding_tokens"?}; 201, probed before the answer
    GET    /admin/replicas/{id}          one replica
    PATCH  /admin/replicas/{id}          a new weight and/or caps
    DELETE /admin/replicas/{id}          removed at once (requests already on it finish)
    POST   /admin/replicas/{id}/drain    no new requests; it leaves once its requests are done (202)

`{id}` is the replica's `name`, or its host:port. The API is off unless `admin_key` is set (then /admin/* is a
404 like any unknown path) and wants `Authorization: Bearer <admin_key>`: none or a wrong one is a 401, a client
API key a 403; an unknown replica is a 404, adding one already there a 409.

Every change goes to the control plane's `ReplicaSet` (gateway/replicaset.py, the replica set's one writer), so it
reaches every worker within 25 ms. With one process the gateway calls `AdminApi` itself; with N workers the
supervisor serves it on a Unix socket and the workers pass /admin/* requests on to it (`relay`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httptools

from .config import ConfigError, ReplicaConfig
from .errors import GatewayError
from .server import Request, Responder, Response

if TYPE_CHECKING:
    from .control import ControlPlane
    from .replicaset import Entry

logger = logging.getLogger(__name__)

PREFIX = "/admin/replicas"
RELAY_TIMEOUT_S = 10.0
_CHANGEABLE = ("weight", "max_requests", "max_outstanding_tokens")


def is_admin_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def _error(exc: GatewayError) -> Response:
    return Response(exc.status, exc.encoded(), headers=exc.headers)


def _json(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(data).encode(), headers=headers or {})


class AdminApi:
    """Answers /admin/replicas requests against the control plane's replica set."""

    def __init__(self, control: ControlPlane) -> None:
        self._control = control

    async def handle(self, request: Request, responder: Responder | None = None) -> Response:
        """One admin request, answered with JSON or an OpenAI-style error (a server handler, too)."""
        try:
            self._authorize(request)
            return await self._route(request)
        except GatewayError as exc:
            return _error(exc)

    def _authorize(self, request: Request) -> None:
        config = self._control.config  # the current one: a SIGHUP reload may change the keys
        if not config.admin_key or not is_admin_path(request.path):
            raise GatewayError(404, f"{request.method} {request.path}: Not Found", code="not_found")
        header = request.headers.get("authorization", "")
        token = header[7:].encode() if header[:7].lower() == "bearer " else b""
        if hmac.compare_digest(token, config.admin_key.encode()):
            return
        if token and any(hmac.compare_digest(token, key.encode()) for key in config.api_keys):
            raise GatewayError(403, "a client API key cannot manage replicas: use the admin key",
                               code="permission_denied")
        raise GatewayError(401, "Incorrect or missing admin key: send `Authorization: Bearer <admin_key>`",
                           code="invalid_api_key")

    async def _route(self, request: Request) -> Response:
        parts = request.path[len(PREFIX):].strip("/").split("/") if request.path != PREFIX else []
        method = request.method
        if not parts:
            if method in ("GET", "HEAD"):
                return _json({"object": "list", "data": [self._view(e) for e in self._entries()]})
            if method == "POST":
                return await self._add(request.body)
            raise _not_allowed(method, request.path, "GET, POST")
        entry = self._find(unquote(parts[0]))
        if len(parts) == 1:
            if method in ("GET", "HEAD"):
                return _json(self._view(entry))
            if method == "PATCH":
                return self._change(entry, request.body)
            if method == "DELETE":
                view = self._view(entry)
                self._control.replicas.remove(entry.url)
                logger.info("admin: removed replica %s (%s)", view["id"], entry.url)
                return _json({**view, "removed": True})
            raise _not_allowed(method, request.path, "GET, PATCH, DELETE")
        if parts[1:] == ["drain"]:
            if method != "POST":
                raise _not_allowed(method, request.path, "POST")
            self._control.replicas.drain(entry.url)
            logger.info("admin: draining replica %s (%s)", entry.config.id, entry.url)
            return _json(self._view(entry), 202)
        raise GatewayError(404, f"{method} {request.path}: Not Found", code="not_found")

    # -- changes ----------------------------------------------------------------------------------------------
    async def _add(self, raw: bytes) -> Response:
        data = _body(raw)
        if "url" not in data:
            raise GatewayError(400, "you must provide the replica's url", param="url", code="invalid_value")
        try:
            config = ReplicaConfig(**data)
        except (ConfigError, TypeError) as exc:
            raise GatewayError(400, str(exc), code="invalid_value") from None
        for entry in self._entries():
            if entry.url == config.url or entry.config.id == config.id:
                raise GatewayError(409, f"replica {entry.config.id} ({entry.url}) is already in the set"
                                   + (" and draining: wait until it has left" if entry.draining else ""),
                                   code="replica_exists")
        entry = self._control.replicas.add(config)
        logger.info("admin: added replica %s (%s)", config.id, config.url)
        if self._control.health is not None:
            await self._control.health.probe(entry, refresh_models=True)  # bounded by health.timeout_s
        return _json(self._view(entry), 201, {"Location": f"{PREFIX}/{config.id}"})

    def _change(self, entry: Entry, raw: bytes) -> Response:
        data = _body(raw)
        fixed = sorted(set(data) - set(_CHANGEABLE))
        if fixed:
            raise GatewayError(400, f"only {', '.join(_CHANGEABLE)} can change; not {', '.join(fixed)}",
                               param=fixed[0], code="invalid_value")
        try:
            config = dataclasses.replace(entry.config, **data)
        except (ConfigError, TypeError) as exc:
            raise GatewayError(400, str(exc), code="invalid_value") from None
        entry = self._control.replicas.add(config)  # a known URL: its weight and caps are updated in place
        logger.info("admin: replica %s now %s", config.id, {k: getattr(config, k) for k in _CHANGEABLE})
        return _json(self._view(entry))

    # -- reading ----------------------------------------------------------------------------------------------
    def _entries(self) -> list[Entry]:
        return list(self._control.replicas.replicas.values())

    def _find(self, replica_id: str) -> Entry:
        for entry in self._entries():
            if entry.config.id == replica_id:
                return entry
        raise GatewayError(404, f"no replica {replica_id!r}", param="id", code="replica_not_found")

    def _view(self, entry: Entry) -> dict[str, Any]:
        config = entry.config
        outstanding, inflight = self._control.replicas.own_load(entry.slot)
        return {"id": config.id, "name": config.name, "url": config.url, "weight": config.weight,
                "max_requests": config.max_requests, "max_outstanding_tokens": config.max_outstanding_tokens,
                "healthy": entry.healthy, "draining": entry.draining, "models": sorted(entry.cards),
                "outstanding_tokens": outstanding, "inflight_requests": inflight}


def _body(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "the request body is not valid JSON", code="invalid_value") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "the request body must be a JSON object", code="invalid_value")
    return data


def _not_allowed(method: str, path: str, allowed: str) -> GatewayError:
    return GatewayError(405, f"{method} is not allowed on {path}; use {allowed}", code="method_not_allowed",
                        headers={"Allow": allowed})


# -- a worker passing admin requests on to the supervisor --------------------------------------------------------
class _Answer:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def relay(socket_path: str, request: Request) -> Response:
    """Pass an admin request on to the supervisor's admin API (a Unix socket) and return its answer."""
    head = [f"{request.method} {request.target} HTTP/1.1", "Host: gateway-admin", "Connection: close",
            f"Content-Length: {len(request.body)}"]
    for name in ("authorization", "content-type"):
        if name in request.headers:
            head.append(f"{name}: {request.headers[name]}")
    answer = _Answer()
    try:
        async with asyncio.timeout(RELAY_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(socket_path)
            try:
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + request.body)
                while not answer.complete and (data := await reader.read(65536)):
                    answer.parser.feed_data(data)
            finally:
                writer.close()
    except (OSError, TimeoutError, httptools.HttpParserError) as exc:
        logger.error("admin: the supervisor's admin API did not answer: %r", exc)
        return _error(GatewayError(503, "the admin API is not available right now; try again",
                                   code="admin_unavailable", headers={"Retry-After": "1"}))
    headers = {k: v for k, v in answer.headers.items() if k in ("allow", "location", "retry-after")}
    return Response(answer.parser.get_status_code(), bytes(answer.body),
                    answer.headers.get("content-type", "application/json"), headers)
