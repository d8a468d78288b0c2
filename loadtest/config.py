"""The load test's settings: one frozen `LoadConfig`, and the options that build it.

The same option set serves `loadtest run` (argparse) and the locustfile (Locust's parser, so the options
show in Locust's web UI too); `to_argv` turns a config back into those options, which is how
`loadtest run` hands its config to the Locust subprocess. Values may arrive as strings (the web UI
sends every field as text), so the builders below convert every value themselves.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from loadtest.schedules import ARRIVALS, ArrivalSpec
from loadtest.workloads import WORKLOADS, RequestSpec, WorkloadSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MODES = ("open", "closed")
CHAT_HOSTS = ("conversation", "turn")  # with several hosts: a conversation keeps one, or each turn takes the next


@dataclass(frozen=True)
class LoadConfig:
    """Everything one load-test run needs."""

    hosts: tuple[str, ...]  # several: the client round-robins over them
    model: str
    endpoint: str = "completions"
    mode: str = "open"  # open: send at the scheduled times; closed: `concurrency` users back to back
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    concurrency: int = 1
    num_requests: int | None = None  # closed mode: stop after this many
    out_dir: str | None = None  # where the locustfile writes records.jsonl and meta.json
    connect_timeout: float = 10.0
    read_timeout: float = 600.0  # longest wait for any byte, the first token included
    drain_timeout: float = 120.0  # how long to wait for requests in flight after the last send
    ignore_eos: bool = True
    max_connections: int = 10_000  # per host; more in flight than this would queue in the client
    chat_hosts: str = "conversation"  # multi-turn over several hosts: each conversation on one, or turn by turn

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("no host: give the URL of the gateway or replica (--host URL)")
        for host in self.hosts:
            parts = urlsplit(host)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"host {host!r} is not an http(s) URL")
        if not self.model:
            raise ValueError("no model: give the served model name (--model NAME)")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency {self.concurrency!r} must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num requests {self.num_requests!r} must be >= 1")
        if self.mode == "open" and math.isinf(self.arrival.duration):
            raise ValueError("an open-loop run needs a finite --duration")
        for name in ("connect_timeout", "read_timeout", "drain_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)!r} must be > 0 seconds")
        if self.max_connections < 1:
            raise ValueError(f"max connections {self.max_connections!r} must be >= 1")
        if self.chat_hosts not in CHAT_HOSTS:
            raise ValueError(f"chat hosts {self.chat_hosts!r} is not one of {', '.join(CHAT_HOSTS)}")

    def host_of(self, request: RequestSpec) -> int:
        """Which host takes `request`: request i host i mod N; a conversation's turns its own host, or with
        `chat_hosts` "turn" turn t of conversation c host (c + t) mod N."""
        if request.conversation is None:
            return request.index % len(self.hosts)
        step = (request.turn or 0) if self.chat_hosts == "turn" else 0
        return (request.conversation + step) % len(self.hosts)

    @property
    def path(self) -> str:
        """The request path, e.g. /v1/completions."""
        return ENDPOINTS[self.endpoint]


def add_arguments(parser: Any) -> None:
    """Add the load options to an argparse-compatible parser (argparse's or Locust's)."""
    group = parser.add_argument_group("load test (smallserve loadtest)")
    add = group.add_argument
    add("--model", default="", help="served model name")
    add("--endpoint", default="completions", choices=list(ENDPOINTS), help="OpenAI API to call (streaming)")
    add("--mode", default="open", choices=list(MODES),
        help="open: send at scheduled times whatever the server does; closed: --concurrency users back to back")
    add("--arrival", default="poisson", choices=list(ARRIVALS), help="open-loop arrival process")
    add("--rate", default="1.0", help="requests/s (the base rate for burst)")
    add("--burstiness", default="1.0", help="gamma shape k: 1 is Poisson, <1 burstier (CV 1/sqrt(k))")
    add("--burst-size", default="10", help="burst: requests sent at once at each burst")
    add("--burst-period", default="10.0", help="burst: seconds between bursts (the first after one period)")
    add("--steps", default="", help="step/ramp: time:rate pairs from time 0, e.g. 0:2,30:5,60:10")
    add("--duration", default="", help="seconds of schedule (open) or of sending (closed); default 60")
    add("--concurrency", default="1", help="closed mode: requests in flight")
    add("--num-requests", default="", help="closed mode: stop after this many requests")
    add("--seed", default="0", help="seed of the schedule and the workload")
    add("--workload", default="fixed", choices=list(WORKLOADS), help="request lengths")
    add("--input-len", default="512", help="prompt tokens (fixed/uniform/lognormal)")
    add("--output-len", default="256", help="output tokens (fixed/uniform/lognormal)")
    add("--range-ratio", default="0.5", help="uniform: lengths in [len*(1-r), len*(1+r)]")
    add("--sigma", default="0.5", help="lognormal: spread of log length (median = len)")
    add("--dataset", default="", help="sharegpt: ShareGPT-format JSON file")
    add("--sharegpt-output-len", default="", help="sharegpt: output tokens instead of the replies' lengths")
    add("--short", default="128:32", help="mix: input:output tokens of a short request")
    add("--long", default="2048:512", help="mix: input:output tokens of a long request")
    add("--long-fraction", default="0.2", help="mix: share of long requests")
    add("--turns", default="2:8", help="multiturn: turns per conversation, MIN:MAX (uniform)")
    add("--system-len", default="256", help="multiturn: tokens of the system prompt all conversations share")
    add("--think-time", default="5.0", help="multiturn: mean seconds from a reply to the next message")
    add("--max-context", default="2048", help="multiturn: end a conversation before a turn past this many tokens")
    add("--adapters", default="", help="LoRA adapters the requests name, comma-separated, most popular first")
    add("--zipf", default="1.0", help="adapter popularity: the k-th adapter with probability ~ 1/k^s (0: uniform)")
    add("--tokenizer", default="", help="the model's tokenizer.json (or its directory): exact prompt lengths")
    add("--prompt-salt", default="0", help="other prompt text with the same lengths and schedule (no prefix-cache "
                                           "hits from an earlier run); compare sets one per target")
    add("--ignore-eos", default="true", choices=["true", "false"], help="ask vLLM for exactly max_tokens")
    add("--connect-timeout", default="10", help="seconds to connect")
    add("--read-timeout", default="600", help="seconds to wait for any byte, the first token included")
    add("--drain-timeout", default="120", help="seconds to wait for requests in flight after the last send")
    add("--max-connections", default="10000", help="connections per host")
    add("--chat-hosts", default="conversation", choices=list(CHAT_HOSTS),
        help="multiturn over several hosts: conversation i keeps host i mod N (one client, one base URL), or turn: "
             "each turn goes to the next host (clients behind a load balancer that spreads requests)")


def _text(value: object) -> str:
    return "" if value is None else str(value).strip()


def _number(name: str, value: object, cast: type[float] | type[int]) -> Any:
    try:
        return cast(_text(value))
    except ValueError:
        raise ValueError(f"{name} {value!r} is not a number") from None


def _optional(name: str, value: object, cast: type[float] | type[int]) -> Any:
    return None if _text(value) == "" else _number(name, value, cast)


def _pairs(name: str, value: object) -> tuple[tuple[float, float], ...]:
    """'0:5,30:10' -> ((0.0, 5.0), (30.0, 10.0))."""
    pairs = []
    for item in filter(None, _text(value).replace(" ", "").split(",")):
        left, sep, right = item.partition(":")
        if not sep:
            raise ValueError(f"{name} item {item!r} is not a:b")
        pairs.append((_number(name, left, float), _number(name, right, float)))
    return tuple(pairs)


def _lengths(name: str, value: object, what: str = "input:output token counts, e.g. 128:32") -> tuple[int, int]:
    try:
        pairs = _pairs(name, value)
    except ValueError:
        pairs = ()
    if len(pairs) != 1 or any(x != int(x) for x in pairs[0]):
        raise ValueError(f"{name} {value!r} is not {what}")
    return int(pairs[0][0]), int(pairs[0][1])


def split_hosts(values: object) -> tuple[str, ...]:
    """Hosts from a comma-separated string or a list of them, trailing slashes dropped."""
    items = values if isinstance(values, (list, tuple)) else [values]
    return tuple(h.rstrip("/") for item in items for h in _text(item).split(",") if h.strip())


def config_from_options(opts: Any, hosts: tuple[str, ...], out_dir: str | None) -> LoadConfig:
    """Build a LoadConfig from parsed options (attribute names as `add_arguments` makes them)."""
    seed = _number("seed", opts.seed, int)
    mode = _text(opts.mode)
    num_requests = _optional("num requests", opts.num_requests, int)
    duration = _optional("duration", opts.duration, float)
    if duration is None:
        duration = math.inf if mode == "closed" and num_requests else 60.0
    arrival = ArrivalSpec(
        kind=_text(opts.arrival), rate=_number("rate", opts.rate, float), duration=duration,
        burstiness=_number("burstiness", opts.burstiness, float),
        burst_size=_number("burst size", opts.burst_size, int),
        burst_period=_number("burst period", opts.burst_period, float),
        steps=_pairs("steps", opts.steps), seed=seed,
    )
    workload = WorkloadSpec(
        kind=_text(opts.workload), input_len=_number("input len", opts.input_len, int),
        output_len=_number("output len", opts.output_len, int),
        range_ratio=_number("range ratio", opts.range_ratio, float), sigma=_number("sigma", opts.sigma, float),
        dataset=_text(opts.dataset) or None,
        sharegpt_output_len=_optional("sharegpt output len", opts.sharegpt_output_len, int),
        short=_lengths("short", opts.short), long=_lengths("long", opts.long),
        long_fraction=_number("long fraction", opts.long_fraction, float), tokenizer=_text(opts.tokenizer) or None,
        prompt_salt=_number("prompt salt", opts.prompt_salt, int), seed=seed,
        turns=_lengths("turns", opts.turns, "MIN:MAX turns, e.g. 2:8"), system_len=_number("system len", opts.system_len, int),
        think_time=_number("think time", opts.think_time, float),
        max_context=_number("max context", opts.max_context, int),
        adapters=tuple(a for a in _text(opts.adapters).split(",") if a),
        zipf_s=_number("zipf", opts.zipf, float),
    )
    return LoadConfig(
        hosts=hosts, model=_text(opts.model), endpoint=_text(opts.endpoint), mode=mode,
        arrival=arrival, workload=workload, concurrency=_number("concurrency", opts.concurrency, int),
        num_requests=num_requests, out_dir=out_dir,
        connect_timeout=_number("connect timeout", opts.connect_timeout, float),
        read_timeout=_number("read timeout", opts.read_timeout, float),
        drain_timeout=_number("drain timeout", opts.drain_timeout, float),
        ignore_eos=_text(opts.ignore_eos).lower() == "true",
        max_connections=_number("max connections", opts.max_connections, int),
        chat_hosts=_text(opts.chat_hosts),
    )


def _join(pairs: tuple[tuple[float, float], ...]) -> str:
    return ",".join(f"{a!r}:{b!r}" for a, b in pairs)


def to_argv(config: LoadConfig) -> list[str]:
    """The options that `config_from_options` turns back into `config` (hosts and out_dir aside)."""
    a, w = config.arrival, config.workload
    values = {
        "--model": config.model, "--endpoint": config.endpoint, "--mode": config.mode,
        "--arrival": a.kind, "--rate": repr(a.rate), "--burstiness": repr(a.burstiness),
        "--burst-size": str(a.burst_size), "--burst-period": repr(a.burst_period), "--steps": _join(a.steps),
        "--duration": repr(a.duration), "--concurrency": str(config.concurrency),
        "--num-requests": "" if config.num_requests is None else str(config.num_requests),
        "--seed": str(a.seed), "--workload": w.kind, "--input-len": str(w.input_len),
        "--output-len": str(w.output_len), "--range-ratio": repr(w.range_ratio), "--sigma": repr(w.sigma),
        "--dataset": w.dataset or "",
        "--sharegpt-output-len": "" if w.sharegpt_output_len is None else str(w.sharegpt_output_len),
        "--short": "%d:%d" % w.short, "--long": "%d:%d" % w.long, "--long-fraction": repr(w.long_fraction),
        "--tokenizer": w.tokenizer or "", "--prompt-salt": str(w.prompt_salt),
        "--turns": "%d:%d" % w.turns, "--system-len": str(w.system_len), "--think-time": repr(w.think_time),
        "--max-context": str(w.max_context), "--adapters": ",".join(w.adapters), "--zipf": repr(w.zipf_s),
        "--ignore-eos": "true" if config.ignore_eos else "false",
        "--connect-timeout": repr(config.connect_timeout), "--read-timeout": repr(config.read_timeout),
        "--drain-timeout": repr(config.drain_timeout), "--max-connections": str(config.max_connections),
        "--chat-hosts": config.chat_hosts,
    }
    return [f"{name}={value}" for name, value in values.items()]


def config_from_dict(data: dict[str, Any]) -> LoadConfig:
    """The LoadConfig that `dataclasses.asdict` (as in meta.json) turned into `data`."""
    arrival = dict(data["arrival"], steps=tuple(tuple(p) for p in data["arrival"].get("steps", ())))
    workload = dict(data["workload"], short=tuple(data["workload"]["short"]), long=tuple(data["workload"]["long"]))
    if "turns" in workload:
        workload["turns"] = tuple(workload["turns"])
    if "adapters" in workload:
        workload["adapters"] = tuple(workload["adapters"])
    return LoadConfig(**dict(data, hosts=tuple(data["hosts"]), arrival=ArrivalSpec(**arrival),
                             workload=WorkloadSpec(**workload)))


def make_parser() -> argparse.ArgumentParser:
    """A bare parser with just the load options (for tests and tools)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser
