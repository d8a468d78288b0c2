"""OpenAI-style errors, mapped once at the boundary.

    GatewayError                    a request the gateway answers with an OpenAI-style error body
     ├── status 400/401/404/405/413 the client's mistake (bad JSON, wrong type, unknown model, ...)
     ├── status 408                 the client took too long to send its request (server.py)
     ├── status 429                 every replica is at its cap and the queue is full or waited too long
     ├── status 502/503/504         no replica could serve it (none healthy, all failed, timed out)
     └── status 503 + Retry-After   the gateway is out of connections or file descriptors (overloaded)
"""

from __future__ import annotations

import json
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class GatewayError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()

    def sse_event(self) -> bytes:
        """The error as a final SSE event, for a stream that has already started."""
        return b"data: " + self.encoded() + b"\n\n"


_UPSTREAM_CODES = {404: "not_found", 405: "method_not_allowed"}


def upstream_error(status: int, body: bytes) -> bytes | None:
    """A replica's 4xx answer as an OpenAI-style error body, or None where it is one already. vLLM's API server is
    FastAPI: a path or method it does not serve gets `{"detail": "Not Found"}`; any other shape (plain text, an
    older `{"object": "error", "message": ...}`) keeps its message."""
    try:
        data: Any = json.loads(body)
    except ValueError:  # not JSON (a UnicodeDecodeError is one)
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return None
    if isinstance(data, dict) and ("detail" in data or "message" in data):
        found = data.get("detail", data.get("message"))
        message = found if isinstance(found, str) else json.dumps(found)
    else:
        message = body.decode("utf-8", "replace").strip()[:500] or f"the replica answered {status}"
    return GatewayError(status, message, code=_UPSTREAM_CODES.get(status)).encoded()


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_value" if param else None)


def overloaded(message: str) -> GatewayError:
    """503 with Retry-After: the gateway itself has no room (connections, file descriptors), not a replica."""
    return GatewayError(503, message, code="server_overloaded", headers={"Retry-After": "1"})
