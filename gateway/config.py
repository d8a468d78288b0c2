"""The gateway's configuration: frozen values, validated at construction, loaded from flags and/or YAML.

YAML (every key optional; flags given on the command line win over the file):

    host: 0.0.0.0
    port: 8000
    policy: prefix_affinity               # estimated_ttft | least_outstanding_tokens | round_robin | random |
                                          # least_requests | power_of_two
    replicas:                             # plain URLs or mappings
      - http://127.0.0.1:8001
      - {url: http://127.0.0.1:8002, weight: 2.0, max_requests: 256, max_outstanding_tokens: 200000,
         max_num_seqs: 256, speed: {step_s: {1: 0.004, 256: 0.031}, prefill_tokens_s: 200000}}
    discovery:                            # DNS names re-resolved on an interval (e.g. a headless Service)
      - {name: vllm.default.svc.cluster.local, port: 8000, scheme: http, interval_s: 10}
    default_max_tokens: 256               # output budget when a request names none
    tokenizers: {my-model: /path/to/tokenizer.json or a model directory}
    timeouts: {connect_s: 5, first_byte_s: 300, idle_s: 60}
    health: {interval_s: 2, timeout_s: 2}
    retry: {max_attempts: 3, max_time_s: 10}
    queue: {max_size: 0, max_wait_s: 30}  # max_size 0: no admission queue (429 when every replica is at its cap)
                                          # headroom: 0 (with priority/fairness: slots per replica kept free for
                                          # tenants and bands within their share, and from less urgent
                                          # bands while a more urgent one is active, docs/priority.md);
                                          # headroom_idle_s: 10 (lent to a flood while no other kind asked)
    max_body_bytes: 4194304
    workers: 1                            # worker processes on the one port; auto: one per CPU available
    feedback: {enabled: false, interval_s: 0.5, timeout_s: 1}  # blend in each replica's own load (vLLM /metrics)
    clients:                              # what a client may take (see SECURITY.md)
      header_timeout_s: 20                # a whole request head, from its first byte (408 past it)
      body_timeout_s: 20                  # between two reads of a request body (408 past it)
      body_min_bytes_per_s: 1024          # a body's average rate after its first body_timeout_s (408 below it)
      send_timeout_s: 60                  # an answer the client reads nothing of for this long is cut off
      keepalive_s: 75                     # an idle keep-alive connection is closed after this
      max_connections: null               # per worker; null: (file-descriptor limit - 64) / 2
    api_keys: [sk-client-1]               # clients must send one of these as a Bearer token
    upstream_api_key: sk-upstream         # sent to the replicas
    admin_key: sk-admin                   # turns on the admin API (/admin/replicas) for this Bearer token
    tracing:                              # OpenTelemetry spans over OTLP (off without an endpoint; docs/tracing.md)
      endpoint: http://127.0.0.1:4318/v1/traces  # grpc: host:port
      protocol: http/protobuf             # or grpc
      sampling_ratio: 1.0                 # of new traces; a client's sampled flag is followed
      service_name: smallserve-gateway
    models:                               # per-model settings (several models behind one gateway; docs/multimodel.md)
      chat: {policy: prefix_affinity, queue: {max_size: 512, max_wait_s: 30}}
      embed: {policy: least_outstanding_tokens}   # what a model leaves out is the gateway's setting
    lora:                                 # LoRA adapters loaded on demand (off unless `adapters` names some)
      adapters: {sql: /models/sql-lora, chat: {path: org/chat-lora, base: my-model}}  # the only names loaded
      max_loras: 1                        # adapters a replica holds at once (vLLM's --max-loras)
      load_timeout_s: 60                  # the longest a request waits for its adapter to be loaded
      sync_s: 10                          # how often each replica's /v1/models is read for its adapters
      slack_tokens: 4096                  # a holder wins while within this many outstanding tokens of the best
    priority:                             # off unless enabled (docs/priority.md); vLLM's convention: lower is sooner
      enabled: false
      header: x-priority                  # a request's priority: this header (an integer or a band's name) or the
      default: 0                          # body's `priority`; the default, and the most urgent a client may ask for
      bands: {interactive: 0, batch: 10}  # names a header may give
      pass_on: false                      # replicas run --scheduling-policy priority: the body carries the priority
    tenants:                              # off unless fair or a rate is set
      fair: false                         # within a priority, share the queue by tokens served (VTC)
      header: null                        # the tenant is this header's value; null: the API key
      tokens_per_s: null                  # each tenant's token rate (prompt + max_tokens), 429 + Retry-After past it
      burst: null                         # tokens a tenant may take at once (default: 10 s of its rate)
      keys: {sk-client-1: {name: acme, priority: 0, tokens_per_s: 5000, burst: 50000}}
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from .speed import Speed, SpeedError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
POLICY_NAMES = ("prefix_affinity", "estimated_ttft", "least_outstanding_tokens", "round_robin", "random",
                "least_requests", "power_of_two", "consistent_hash")
DEFAULT_POLICY = POLICY_NAMES[0]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names it."""


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok or not math.isfinite(value):
        raise ConfigError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


def _check_url(url: object) -> str:
    if not isinstance(url, str):
        raise ConfigError(f"replica {url!r} is not an http(s) URL")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"replica {url!r} is not an http(s) URL")
    return url.rstrip("/")


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica: where it is, its relative capacity, its admission caps (None: uncapped), its vLLM batch cap
    (None: read from its metrics, else its max_requests) and its measured speed (None: the defaults)."""

    @property
    def id(self) -> str:
        """Its name, or host:port: how the admin API's paths name it."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"

    url: str
    weight: float = 1.0
    max_requests: int | None = None
    max_outstanding_tokens: int | None = None
    max_num_seqs: int | None = None
    speed: Speed | None = None
    name: str | None = None  # what the admin API calls it (default: host:port)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _check_url(self.url))
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.fullmatch(self.name)):
            raise ConfigError(f"replica {self.url!r} name must be letters, digits, '.', '_' or '-' (at most 63), "
                              f"got {self.name!r}")
        _positive(f"replica {self.url!r} weight", self.weight)
        if self.speed is not None and not isinstance(self.speed, Speed):
            try:
                object.__setattr__(self, "speed", Speed.from_mapping(self.speed, f"replica {self.url!r} speed"))
            except SpeedError as exc:
                raise ConfigError(str(exc)) from None
        for name in ("max_requests", "max_outstanding_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"replica {self.url!r} {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class DiscoveryConfig:
    """A DNS name whose addresses are replicas, re-resolved every `interval_s`."""

    name: str
    port: int = 8000
    scheme: str = "http"
    interval_s: float = 10.0
    weight: float = 1.0
    max_requests: int | None = None
    max_outstanding_tokens: int | None = None
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"discovery name must be a host name, got {self.name!r}")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ConfigError(f"discovery {self.name!r} port must be 1..65535, got {self.port!r}")
        if self.scheme not in ("http", "https"):
            raise ConfigError(f"discovery {self.name!r} scheme must be http or https, got {self.scheme!r}")
        _positive(f"discovery {self.name!r} interval_s", self.interval_s)


@dataclass(frozen=True)
class Timeouts:
    """Seconds allowed to connect, to receive the response head, and between two body chunks."""

    connect_s: float = 5.0
    first_byte_s: float = 300.0
    idle_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f"timeouts.{f.name}", getattr(self, f.name))


@dataclass(frozen=True)
class HealthConfig:
    """Active health probes: how often, and how long one may take."""

    interval_s: float = 2.0
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f"health.{f.name}", getattr(self, f.name))


@dataclass(frozen=True)
class RetryConfig:
    """Retries before the first byte reaches the client, bounded in attempts and in time."""

    max_attempts: int = 3
    max_time_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"retry.max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        _positive("retry.max_time_s", self.max_time_s)


@dataclass(frozen=True)
class QueueConfig:
    """The admission queue used when every candidate replica is at its cap (max_size 0: no queue)."""

    max_size: int = 0
    max_wait_s: float = 30.0
    headroom: int = 0  # with priority or fairness on: slots per replica kept for kinds with nothing queued
    headroom_idle_s: float = 10.0  # ... and lent to a flood when no other kind asked for a slot this long

    def __post_init__(self) -> None:
        if not isinstance(self.max_size, int) or isinstance(self.max_size, bool) or self.max_size < 0:
            raise ConfigError(f"queue.max_size must be an integer >= 0, got {self.max_size!r}")
        if not isinstance(self.headroom, int) or isinstance(self.headroom, bool) or self.headroom < 0:
            raise ConfigError(f"queue.headroom must be an integer >= 0, got {self.headroom!r}")
        _positive("queue.max_wait_s", self.max_wait_s)
        _positive("queue.headroom_idle_s", self.headroom_idle_s)


@dataclass(frozen=True)
class ClientConfig:
    """How long clients may take (as nginx's client_*_timeout, send_timeout) and how many may be connected."""

    header_timeout_s: float = 20.0
    body_timeout_s: float = 20.0
    body_min_bytes_per_s: float = 1024.0
    send_timeout_s: float = 60.0
    keepalive_s: float = 75.0
    max_connections: int | None = None  # None: derived from the file-descriptor limit (gateway/limits.py)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "max_connections":
                _positive(f"clients.{f.name}", getattr(self, f.name))
        value = self.max_connections
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"clients.max_connections must be a positive integer or null, got {value!r}")


@dataclass(frozen=True)
class FeedbackConfig:
    """Replica-load feedback: scrape every replica's vLLM /metrics every `interval_s` and blend it in."""

    enabled: bool = False
    interval_s: float = 0.5
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"feedback.enabled must be true or false, got {self.enabled!r}")
        _positive("feedback.interval_s", self.interval_s)
        _positive("feedback.timeout_s", self.timeout_s)


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry export: off while `endpoint` is None (client trace headers still reach the replicas)."""

    endpoint: str | None = None
    protocol: str = "http/protobuf"
    sampling_ratio: float = 1.0
    service_name: str = "smallserve-gateway"
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.endpoint is not None and (not isinstance(self.endpoint, str) or not self.endpoint):
            raise ConfigError(f"tracing endpoint must be a URL (or host:port for grpc), got {self.endpoint!r}")
        if self.protocol not in ("http/protobuf", "grpc"):
            raise ConfigError(f"tracing protocol must be http/protobuf or grpc, got {self.protocol!r}")
        if self.protocol == "http/protobuf" and self.endpoint is not None and \
                urlsplit(self.endpoint).scheme not in ("http", "https"):
            raise ConfigError(f"tracing endpoint {self.endpoint!r} must be an http(s) URL for http/protobuf")
        ratio = self.sampling_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise ConfigError(f"tracing sampling_ratio must be between 0 and 1, got {ratio!r}")
        if not isinstance(self.service_name, str) or not self.service_name:
            raise ConfigError(f"tracing service_name must be a non-empty string, got {self.service_name!r}")
        _positive("tracing timeout_s", self.timeout_s)


@dataclass(frozen=True)
class AdapterSpec:
    """One registered LoRA adapter: the name clients ask for, what vLLM loads it from, the base it needs."""

    name: str
    path: str  # a local directory or a Hugging Face repository: given to vLLM's /v1/load_lora_adapter
    base: str | None = None  # the base model a replica must serve to take it (None: any replica)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(f"lora adapter name must be letters, digits, '.', '_' or '-' (at most 63), "
                              f"got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"lora adapter {self.name!r} needs a path or repository, got {self.path!r}")
        if self.base is not None and (not isinstance(self.base, str) or not self.base):
            raise ConfigError(f"lora adapter {self.name!r} base must be a model name, got {self.base!r}")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters the gateway loads on demand (docs/lora.md); off while `adapters` is empty."""

    adapters: tuple[AdapterSpec, ...] = ()
    max_loras: int = 1
    load_timeout_s: float = 60.0
    sync_s: float = 10.0
    slack_tokens: int = 4096  # a holder wins while its outstanding tokens exceed the best's by at most this

    def __post_init__(self) -> None:
        if isinstance(self.adapters, dict):
            object.__setattr__(self, "adapters", tuple(_adapter(k, v) for k, v in self.adapters.items()))
        if not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 1:
            raise ConfigError(f"lora.max_loras must be a positive integer, got {self.max_loras!r}")
        _positive("lora.load_timeout_s", self.load_timeout_s)
        _positive("lora.sync_s", self.sync_s)
        _positive("lora.slack_tokens", self.slack_tokens, allow_zero=True)

    @property
    def enabled(self) -> bool:
        return bool(self.adapters)

    def registry(self) -> dict[str, AdapterSpec]:
        return {a.name: a for a in self.adapters}


def _adapter(name: object, value: object) -> AdapterSpec:
    if isinstance(value, AdapterSpec):
        return value
    if isinstance(value, str):
        return AdapterSpec(str(name), value)
    if isinstance(value, dict) and set(value) <= {"path", "base"}:
        return AdapterSpec(str(name), value.get("path"), value.get("base"))  # type: ignore[arg-type]
    raise ConfigError(f"lora adapter {name!r} must be a path, or a mapping with path (and base), got {value!r}")


PRIORITY_RANGE = (-(2 ** 31), 2 ** 31 - 1)  # vLLM's `priority` is a 32-bit int in practice; any int fits its schema


def _priority(name: str, value: object) -> int:
    lo, hi = PRIORITY_RANGE
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an integer in {lo}..{hi}, got {value!r}")
    return value


@dataclass(frozen=True)
class PriorityConfig:
    """Request priorities (vLLM's convention: a lower value is served sooner); off unless `enabled`."""

    enabled: bool = False
    header: str = "x-priority"
    default: int = 0
    bands: tuple[tuple[str, int], ...] = ()
    pass_on: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool) or not isinstance(self.pass_on, bool):
            raise ConfigError("priority.enabled and priority.pass_on must be true or false")
        if not isinstance(self.header, str) or not _NAME.fullmatch(self.header):
            raise ConfigError(f"priority.header must be a header name, got {self.header!r}")
        object.__setattr__(self, "header", self.header.lower())
        _priority("priority.default", self.default)
        bands = dict(self.bands) if isinstance(self.bands, dict) else self.bands
        if isinstance(bands, dict):
            bands = tuple(bands.items())
        for band, value in bands:
            if not isinstance(band, str) or not _NAME.fullmatch(band) or band.lstrip("-").isdigit():
                raise ConfigError(f"priority.bands: {band!r} is not a name (letters, digits, '.', '_', '-')")
            _priority(f"priority.bands.{band}", value)
        object.__setattr__(self, "bands", tuple(bands))


@dataclass(frozen=True)
class TenantKey:
    """What one API key means: its tenant's name, its priority (default and most urgent allowed), its rate."""

    name: str | None = None
    priority: int | None = None
    tokens_per_s: float | None = None
    burst: float | None = None

    def check(self, where: str) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.fullmatch(self.name)):
            raise ConfigError(f"{where}.name must be letters, digits, '.', '_' or '-', got {self.name!r}")
        if self.priority is not None:
            _priority(f"{where}.priority", self.priority)
        for name in ("tokens_per_s", "burst"):
            if getattr(self, name) is not None:
                _positive(f"{where}.{name}", getattr(self, name))


@dataclass(frozen=True)
class TenantsConfig:
    """Who a request is for (its API key, or a header) and what each tenant gets: a fair share, a token rate."""

    fair: bool = False
    header: str | None = None
    tokens_per_s: float | None = None
    burst: float | None = None
    keys: tuple[tuple[str, TenantKey], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.fair, bool):
            raise ConfigError(f"tenants.fair must be true or false, got {self.fair!r}")
        if self.header is not None:
            if not isinstance(self.header, str) or not _NAME.fullmatch(self.header):
                raise ConfigError(f"tenants.header must be a header name, got {self.header!r}")
            object.__setattr__(self, "header", self.header.lower())
        for name in ("tokens_per_s", "burst"):
            if getattr(self, name) is not None:
                _positive(f"tenants.{name}", getattr(self, name))
        keys = self.keys.items() if isinstance(self.keys, dict) else self.keys
        built = []
        for i, (key, item) in enumerate(keys):
            where = f"tenants.keys[{i}]"  # never the key itself: it is a secret
            if not isinstance(key, str) or not key:
                raise ConfigError(f"{where}: API keys must be non-empty strings")
            if isinstance(item, dict):
                item = _build(TenantKey, where, item)
            if not isinstance(item, TenantKey):
                raise ConfigError(f"{where} must be a mapping of name, priority, tokens_per_s, burst")
            item.check(where)
            built.append((key, item))
        object.__setattr__(self, "keys", tuple(built))

    @property
    def enabled(self) -> bool:
        """Whether requests need a tenant at all (fair sharing or a token rate somewhere)."""
        return self.fair or self.tokens_per_s is not None or any(k.tokens_per_s is not None for _, k in self.keys)


def cpu_count() -> int:
    """CPUs this process may use: its affinity, and a cgroup v2 CPU quota where there is one (containers)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
    except (OSError, ValueError):
        return count
    return count if quota == "max" else max(1, min(count, math.ceil(int(quota) / int(period))))


def workers_value(value: object) -> int:
    """`workers`: a positive integer, or "auto" for the CPUs available."""
    if value == "auto":
        return cpu_count()
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"workers must be a positive integer or auto, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """One model's own routing settings, where they differ from the gateway's (None: the gateway's)."""

    policy: str | None = None
    queue: QueueConfig | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICY_NAMES:
            raise ConfigError(f"models: policy {self.policy!r} is not one of {', '.join(POLICY_NAMES)}")
        if self.queue is not None and not isinstance(self.queue, QueueConfig):
            object.__setattr__(self, "queue", _build(QueueConfig, "models: queue", self.queue))


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway needs to run."""

    replicas: tuple[ReplicaConfig, ...] = ()
    discovery: tuple[DiscoveryConfig, ...] = ()
    host: str = "0.0.0.0"
    port: int = 8000
    policy: str = DEFAULT_POLICY
    default_max_tokens: int = 256
    tokenizers: tuple[tuple[str, str], ...] = ()
    timeouts: Timeouts = field(default_factory=Timeouts)
    health: HealthConfig = field(default_factory=HealthConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    max_body_bytes: int = 4 * 1024 * 1024
    workers: int = 1
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    clients: ClientConfig = field(default_factory=ClientConfig)
    api_keys: tuple[str, ...] = ()
    upstream_api_key: str | None = None
    admin_key: str | None = None
    log_level: str = "info"
    tracing: TracingConfig = field(default_factory=TracingConfig)
    models: tuple[tuple[str, ModelConfig], ...] = ()  # model name -> its own settings
    lora: LoraConfig = field(default_factory=LoraConfig)
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)

    def __post_init__(self) -> None:
        if not self.replicas and not self.discovery:
            raise ConfigError("no replicas: give --replica URL (or replicas:/discovery: in the config file)")
        urls = [r.url for r in self.replicas]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"replicas are listed twice: {sorted(u for u in set(urls) if urls.count(u) > 1)}")
        ids = [r.id for r in self.replicas]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"replica names (or host:port) are not unique: "
                              f"{sorted(i for i in set(ids) if ids.count(i) > 1)}")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"policy {self.policy!r} is not one of {', '.join(POLICY_NAMES)}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port must be 0..65535, got {self.port!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens <= 0:
            raise ConfigError(f"default_max_tokens must be a positive integer, got {self.default_max_tokens!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes <= 0:
            raise ConfigError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        workers_value(self.workers)
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ConfigError("api_keys must be non-empty strings")
        if self.admin_key is not None and (not isinstance(self.admin_key, str) or not self.admin_key):
            raise ConfigError("admin_key must be a non-empty string")
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise ConfigError("admin_key must not also be a client API key")
        if self.api_keys and any(k not in self.api_keys for k, _ in self.tenants.keys):
            raise ConfigError("tenants.keys names a key that api_keys does not list")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    def tokenizer_map(self) -> dict[str, str]:
        return dict(self.tokenizers)

    def model_map(self) -> dict[str, ModelConfig]:
        return dict(self.models)


_SECTIONS = {"timeouts": Timeouts, "health": HealthConfig, "retry": RetryConfig, "queue": QueueConfig,
             "feedback": FeedbackConfig, "clients": ClientConfig, "tracing": TracingConfig, "lora": LoraConfig,
             "priority": PriorityConfig, "tenants": TenantsConfig}


def _build(cls: type, where: str, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {data!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {', '.join(map(str, unknown))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _replica(item: Any) -> ReplicaConfig:
    if isinstance(item, str):
        return ReplicaConfig(url=item)
    return _build(ReplicaConfig, "replicas[]", item)  # type: ignore[no-any-return]


def _models(data: Any) -> tuple[tuple[str, ModelConfig], ...]:
    if not isinstance(data, dict):
        raise ConfigError("models must map model names to their settings ({policy, queue})")
    items = []
    for name, settings in data.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"models: a model name must be a non-empty string, got {name!r}")
        items.append((name, settings if isinstance(settings, ModelConfig) else
                      _build(ModelConfig, f"models: {name}", settings or {})))
    return tuple(items)


def from_mapping(data: dict[str, Any]) -> GatewayConfig:
    """Build a config from a parsed YAML mapping, naming any bad key or value."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config file must hold a mapping, got {type(data).__name__}")
    data = dict(data)
    for key, cls in _SECTIONS.items():
        if key in data:
            data[key] = _build(cls, key, data[key])
    if "replicas" in data:
        if not isinstance(data["replicas"], list):
            raise ConfigError("replicas must be a list")
        data["replicas"] = tuple(_replica(r) for r in data["replicas"])
    if "discovery" in data:
        if not isinstance(data["discovery"], list):
            raise ConfigError("discovery must be a list")
        data["discovery"] = tuple(_build(DiscoveryConfig, "discovery[]", d) for d in data["discovery"])
    if "tokenizers" in data:
        if not isinstance(data["tokenizers"], dict):
            raise ConfigError("tokenizers must map model names to tokenizer paths")
        data["tokenizers"] = tuple((str(k), str(v)) for k, v in data["tokenizers"].items())
    if "models" in data:
        data["models"] = _models(data["models"])
    if "workers" in data:
        data["workers"] = workers_value(data["workers"])
    if "api_keys" in data:
        if not isinstance(data["api_keys"], list):
            raise ConfigError("api_keys must be a list of strings")
        data["api_keys"] = tuple(data["api_keys"])
    return _build(GatewayConfig, "the config file", data)  # type: ignore[no-any-return]


def to_mapping(config: GatewayConfig) -> dict[str, Any]:
    """The config as plain data that `from_mapping` reads back (how the supervisor hands it to its workers)."""
    data = asdict(config)
    data["tokenizers"] = dict(config.tokenizers)
    data["models"] = {name: asdict(model) for name, model in config.models}
    for key in ("replicas", "discovery", "api_keys"):
        data[key] = list(data[key])
    data["lora"]["adapters"] = {a.name: {"path": a.path, "base": a.base} for a in config.lora.adapters}
    data["priority"]["bands"] = dict(config.priority.bands)
    data["tenants"]["keys"] = {key: asdict(item) for key, item in config.tenants.keys}
    for item, replica in zip(data["replicas"], config.replicas):
        item["speed"] = replica.speed.to_mapping() if replica.speed else None
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping (empty file: empty mapping)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    return data or {}
