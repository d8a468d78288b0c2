"""Where a request's time to first token went, from the spans of one trace: the gateway's and vLLM's.

The client sends each request with its own W3C trace id; the gateway (tracing on, every request sampled) records
`gateway.request` (its own time to the replica's first byte) and `gateway.queue` (the wait in its admission queue),
and passes the trace on to vLLM, which records `llm_request` with its engine's times (`--otlp-traces-endpoint`).
Per request, as the client saw it:

    client TTFT = the client's own share (its loop, the HTTP hops to and from the gateway)
                + the gateway's queue
                + the rest of the gateway's time to first byte outside vLLM's engine (the pick, the connection,
                  vLLM's HTTP server: parsing, tokenizing, handing the request to the engine)
                + vLLM's queue (waiting for the engine's scheduler) + vLLM's prefill and first step
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.otlp_collector import Span


def new_trace() -> tuple[str, str]:
    """A fresh sampled trace: its id, and the `traceparent` header that starts it."""
    trace, parent = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    return trace, f"00-{trace}-{parent}-01"


@dataclass(frozen=True)
class Parts:
    """One request's time to first token, split (seconds)."""

    client_ttft: float
    gateway_ttft: float  # gateway.request's time to the replica's first byte
    gateway_queue: float  # gateway.queue's length; 0 when it did not wait
    engine_queue: float  # vLLM's time in queue
    engine_ttft: float  # vLLM's time to first token (from its arrival at vLLM's engine client)

    @property
    def client(self) -> float:
        return self.client_ttft - self.gateway_ttft

    @property
    def path(self) -> float:
        """The gateway's time to first byte that is neither its queue nor vLLM's engine."""
        return self.gateway_ttft - self.gateway_queue - self.engine_ttft

    @property
    def engine_work(self) -> float:
        return self.engine_ttft - self.engine_queue


def split(spans: Iterable[Span], client_ttft: dict[str, float]) -> dict[str, Parts]:
    """`Parts` for each trace id of `client_ttft` whose gateway and vLLM spans are all in `spans`."""
    by_trace: dict[str, list[Span]] = {}
    for span in spans:
        if span.trace_id in client_ttft:
            by_trace.setdefault(span.trace_id, []).append(span)
    out = {}
    for trace, found in by_trace.items():
        named = {s.name: s for s in found}
        request, engine = named.get("gateway.request"), named.get("llm_request")
        if request is None or engine is None:
            continue
        queue = named.get("gateway.queue")
        out[trace] = Parts(client_ttft[trace], float(request.attributes["gen_ai.latency.time_to_first_token"]),
                           queue.seconds if queue is not None else 0.0,
                           float(engine.attributes.get("gen_ai.latency.time_in_queue", 0.0)),
                           float(engine.attributes["gen_ai.latency.time_to_first_token"]))
    return out


PARTS = ("client", "gateway_queue", "path", "engine_queue", "engine_work")
LABELS = ("client's share", "gateway queue", "gateway path, vLLM's HTTP", "vLLM queue", "vLLM prefill, step")


def medians(parts: Sequence[Parts]) -> dict[str, float]:
    """The median of each part and of the whole (the client's TTFT) over `parts`."""
    if not parts:
        return {}
    out = {name: float(statistics.median(getattr(p, name) for p in parts)) for name in PARTS}
    out["client_ttft"] = float(statistics.median(p.client_ttft for p in parts))
    return out


def table(rows: dict[str, tuple[int, dict[str, float]]]) -> list[str]:
    """Markdown rows: per label, how many requests and their median parts in ms."""
    lines = ["| requests | n | TTFT | " + " | ".join(LABELS) + " |", "|---|---:|---:|" + "---:|" * len(LABELS)]
    for label, (n, m) in rows.items():
        cells = [f"{m[name] * 1e3:.1f}" for name in ("client_ttft", *PARTS)] if m else [""] * (len(PARTS) + 1)
        lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    return lines
