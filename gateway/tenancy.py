"""Who a request is for and how urgent it is: its tenant and priority, from its API key, headers and body.

Built only when `priority.enabled` or the tenants section asks for it (gateway/app.py); otherwise no request
pays for any of this. vLLM's convention holds throughout: a lower priority value is served sooner.

- Priority: the `priority` header (an integer, or a band's name from config) or the body's `priority` (vLLM's
  field); both given and different is a 400. The API key's configured priority (else `priority.default`) is the
  default and the most urgent a request may ask for: asking for more is a 403.
- Tenant: the configured header's value, else the API key's configured name, else a digest of the key (the key
  itself never appears in a log, a metric or an error), else "" (anonymous: one tenant).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

import msgspec

from .config import PRIORITY_RANGE, PriorityConfig, TenantKey, TenantsConfig
from .errors import GatewayError, bad_request
from .parsing import RequestInfo
from .server import Request

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
_NO_KEY = TenantKey()


def bearer(request: Request) -> str:
    """The request's Bearer token, or ""."""
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def key_tenant(token: str) -> str:
    """The tenant an API key with no configured name stands for: a digest, so the key never shows."""
    return "key-" + hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Classified:
    """A request's info with its priority and tenant, and the body to send on (changed only to carry them)."""

    info: RequestInfo
    body: bytes


class Classifier:
    """Gives each request its priority and tenant, refusing bad values with an OpenAI-style 4xx."""

    def __init__(self, priority: PriorityConfig, tenants: TenantsConfig) -> None:
        self._priority = priority
        self._tenants = tenants
        self._bands = dict(priority.bands)
        self._keys = dict(tenants.keys)
        self._digests: dict[str, str] = {}

    def classify(self, request: Request, info: RequestInfo) -> Classified:
        """`info` with its priority and tenant set; `info.priority` holds the body's value (None: none given)."""
        token = bearer(request)
        key = self._keys.get(token, _NO_KEY) if token else _NO_KEY
        priority = self._priority_of(request, info.priority, key) if self._priority.enabled else 0
        tenant = self._tenant_of(request, token, key)
        return Classified(replace(info, priority=priority, tenant=tenant),
                          self._body(request.body, info.priority, priority))

    def _priority_of(self, request: Request, body: int | None, key: TenantKey) -> int:
        floor = key.priority if key.priority is not None else self._priority.default
        header = self._priority.header
        raw = request.headers.get(header)
        value = body
        if raw is not None:
            value = self._parse_header(raw.strip(), header)
            if body is not None and body != value:
                raise bad_request(f"the {header} header ({value}) and the body's 'priority' ({body}) disagree; "
                                  "send one", "priority")
        if value is None:
            return floor
        if value < floor:
            raise GatewayError(403, f"priority {value} is more urgent than this client may ask for (at most {floor}; "
                               "a lower value is served sooner)", param="priority", code="priority_not_allowed")
        return value

    def _parse_header(self, raw: str, header: str) -> int:
        band = self._bands.get(raw)
        if band is not None:
            return band
        try:
            value = int(raw, 10)
        except ValueError:
            names = ", ".join(sorted(self._bands)) or "none configured"
            raise bad_request(f"the {header} header must be an integer or a priority band ({names}), got "
                              f"{raw[:64]!r}", "priority") from None
        lo, hi = PRIORITY_RANGE
        if not lo <= value <= hi:
            raise bad_request(f"the {header} header must be in {lo}..{hi}, got {raw[:64]}", "priority")
        return value

    def _tenant_of(self, request: Request, token: str, key: TenantKey) -> str:
        header = self._tenants.header
        if header is not None:
            raw = request.headers.get(header)
            if raw is not None:
                if not _TENANT.fullmatch(raw):
                    raise bad_request(f"the {header} header must be 1-128 letters, digits or '._:@-', starting "
                                      "with a letter or digit", header)
                return raw
        if key.name is not None:
            return key.name
        if not token:
            return ""
        digest = self._digests.get(token)
        if digest is None:
            if len(self._digests) > 4096:  # unknown keys (no api_keys configured): keep the memo bounded
                self._digests.clear()
            digest = self._digests[token] = key_tenant(token)
        return digest

    def _body(self, raw: bytes, given: int | None, priority: int) -> bytes:
        """The body as the replica should see it: carrying the priority (pass_on), or without one it cannot take."""
        if not self._priority.enabled:
            return raw
        if self._priority.pass_on:
            if given is not None or priority == 0:
                return raw  # it carries the priority already (a different one was refused above), or needs none
            start = raw.index(b"{")  # a JSON object: parse() checked it
            return b'%b{"priority":%d,%b' % (raw[:start], priority, raw[start + 1:])
        if given is None or given == 0:
            return raw
        # vLLM without priority scheduling refuses a priority other than 0: the gateway has used it, so drop it
        body = msgspec.json.decode(raw)
        body.pop("priority", None)
        return msgspec.json.encode(body)
