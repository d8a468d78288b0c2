"""One replica's scheduler, as vLLM does it: a batch cap, a token budget, 16-token KV blocks, preemption.

Each step the engine picks a batch, spends the step's host time, then submits the step's device time to the
shared GPU; when the device part completes it applies the step (tokens out, requests finished, blocks freed)
and picks the next batch. Two scheduling policies:

- V0 (vLLM <= 0.6 default, the reference's engine): a step is either a prefill step (whole prompts of waiting
  requests, FCFS, while the token budget, the batch cap and the free blocks above the 1% watermark allow) or a
  decode step (one token for every running request). Prefill has priority.
- chunked (vLLM V1): every step decodes all running requests, then spends the rest of the token budget on
  prompt chunks, first of partly prefilled requests, then of newly admitted ones.

A decode step needs one more block for each sequence whose length crosses a 16-token boundary; when the free
blocks run out the engine preempts the most recently admitted running request (recompute: its blocks are freed
and it goes back to the front of the waiting queue, to prefill prompt plus output so far).

Automatic prefix caching (`enable_prefix_caching`, vLLM's APC): a request may carry the hashes of its token
sequence's full blocks (`SimRequest.blocks`, chained as vLLM chains them, so equal hashes mean equal prefixes).
At admission the longest run of leading blocks found in the cache is taken as computed (at least one prompt token
is always computed, as in vLLM): those blocks are shared, not allocated, and cost no prefill. A request's full
blocks are entered into the cache when its prefill ends (the prompt's) and when it leaves (all of them). Blocks
no running request holds stay cached but count as free; allocating past the empty blocks evicts the least
recently freed (a request's tail blocks before its head, as vLLM frees them in reverse).

Per-step work is O(1) in the batch size: decoding sequences are kept as aggregates (count, total length,
sequences per length mod 16) against a step counter, finishing ones in a heap keyed by their last step. A
request's own counts are computed when needed. Only requests with a per-token listener (HTTP streaming) are
visited each step.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .clock import Clock
from .device import SharedDevice
from .steptime import StepTime

WAITING, PREFILL, DECODE, FINISHED, ABORTED = "waiting", "prefill", "decode", "finished", "aborted"

Callback = Callable[["SimRequest"], None]
TokenCallback = Callable[["SimRequest", int], None]


@dataclass(frozen=True)
class EngineConfig:
    """One replica's scheduler limits (vLLM's names)."""

    num_gpu_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    watermark: float = 0.01
    chunked_prefill: bool = False
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}) without chunked prefill")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_gpu_blocks)


class SimRequest:
    """One request's state inside an engine. `on_*` are called at the simulated times of the events."""

    __slots__ = ("rid", "prompt_tokens", "max_tokens", "arrival", "state", "generated", "start", "c0", "epoch",
                 "prefilled", "target", "first_token_at", "finished_at", "preemptions", "error",
                 "on_first_token", "on_token", "on_finish", "tag", "blocks", "refs", "cached_tokens",
                 "scheduled_at", "queued_at")

    _ids = itertools.count()

    def __init__(self, prompt_tokens: int, max_tokens: int,
                 on_first_token: Callback | None = None, on_token: TokenCallback | None = None,
                 on_finish: Callback | None = None, tag: object = None,
                 blocks: Sequence[int] | None = None) -> None:
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"a request needs >= 1 prompt and output token, got {prompt_tokens}, {max_tokens}")
        self.rid = next(SimRequest._ids)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival = 0.0  # when the engine got it
        self.state = WAITING
        self.generated = 0  # while decoding: generated when it entered the decode set (see Engine.generated)
        self.start = 0  # decode step counter when it entered the decode set
        self.c0 = 0  # its length then
        self.epoch = 0  # invalidates stale entries in the finish heap
        self.prefilled = 0
        self.target = 0  # tokens its (re)prefill must compute: prompt plus output so far
        self.first_token_at: float | None = None
        self.scheduled_at: float | None = None  # first taken into a batch (vLLM's scheduled_ts; preemptions aside)
        self.queued_at: float | None = None  # the first step boundary since its arrival (vLLM's queued_ts, below)
        self.finished_at: float | None = None
        self.preemptions = 0
        self.error: str | None = None
        self.on_first_token = on_first_token
        self.on_token = on_token
        self.on_finish = on_finish
        self.tag = tag
        self.blocks = blocks  # hashes of the sequence's full blocks (prompt, then output): for prefix caching
        self.refs: list[int] = []  # cached blocks it holds (a leading run of `blocks`)
        self.cached_tokens = 0  # prompt tokens found in the prefix cache, over all its admissions


def _blocks(tokens: int, size: int) -> int:
    return -(-tokens // size)


class Engine:
    """One simulated vLLM replica."""

    def __init__(self, config: EngineConfig, steptime: StepTime, device: SharedDevice, clock: Clock,
                 name: str = "replica", host_on_device: bool = False) -> None:
        self.config, self.steptime, self.device, self.clock, self.name = config, steptime, device, clock, name
        # The whole step (host part too) is work on `device`: a CPU replica whose one core its API server shares.
        self.host_on_device = host_on_device
        self._bs = config.block_size
        self.waiting: deque[SimRequest] = deque()
        self.running: dict[int, SimRequest] = {}  # admission order: the last is the first to be preempted
        self.prefilling: list[SimRequest] = []
        self.used_blocks = 0
        self._steps = 0  # decode steps so far
        self._n_dec = 0
        self._len_base = 0  # sum over decoding requests of (length at entry - step at entry)
        self._gen_base = 0  # same for generated tokens
        self._gen_other = 0  # generated tokens of in-flight requests that are not decoding
        self._phase = [0] * self._bs  # decoding requests by (length at entry - step at entry) mod block size
        self._finish: list[tuple[int, int, int, SimRequest]] = []
        self._streams: dict[int, SimRequest] = {}
        self._aborts: list[SimRequest] = []
        self._arrived: list[SimRequest] = []  # arrived since the last step boundary: not yet in vLLM's scheduler
        self._busy = False
        self._kicked = False
        self._decode = False
        self._chunks: list[tuple[SimRequest, int, int]] = []
        self._apc = config.enable_prefix_caching
        self._cached: dict[int, int] = {}  # block hash -> running requests holding it (counted in used_blocks)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        # Counters (vLLM's metrics read these).
        self.num_preemptions = 0
        self.prompt_tokens_total = 0  # prompt tokens computed: prefill chunks, recomputation after preemption too
        # Whole prompts, counted at each request's first token, and the part found in the prefix cache: what vLLM
        # counts as vllm:prompt_tokens and vllm:prompt_tokens_cached (cached tokens included in the first).
        self.prompt_tokens_received = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens_total = 0
        self.finished_total = 0
        self.steps_total = 0
        self.iteration_tokens_total = 0  # tokens of every step: one per decoding sequence plus prompt chunks
        self.max_blocks_used = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found
        # vLLM's request_queue_time / request_prefill_time histograms (sum, count), taken when a request finishes:
        # queued -> first scheduled, first scheduled -> first token. vLLM's engine core takes in new requests between
        # steps, and its scheduler stamps a request queued then: a request that arrives during a step waits for
        # that step's end before its queue time starts (its TTFT counts the wait; vLLM's split puts it outside the
        # engine's queue, with the API server's time).
        self.queue_time = [0.0, 0]
        self.prefill_time = [0.0, 0]

    # -- the outside --------------------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        """A request arrives (now)."""
        blocks = _blocks(req.prompt_tokens + req.max_tokens, self._bs)
        if req.prompt_tokens + req.max_tokens > self.config.max_model_len or \
                blocks > self.config.num_gpu_blocks - self.config.watermark_blocks:
            req.error = (f"prompt ({req.prompt_tokens}) + max_tokens ({req.max_tokens}) exceeds the "
                         f"{min(self.config.max_model_len, self.config.num_gpu_blocks * self._bs)}-token limit")
            self._end(req, ABORTED)
            return
        req.arrival = self.clock.now()
        self._arrived.append(req)
        self.waiting.append(req)
        self._kick()

    def abort(self, req: SimRequest) -> None:
        """The client went away: drop the request and free its blocks (at the next step boundary)."""
        if req.state in (FINISHED, ABORTED):
            return
        if req.state == WAITING:
            self.waiting.remove(req)
            self._gen_other -= req.generated
            self._end(req, ABORTED)
        elif self._busy:
            self._aborts.append(req)
        else:
            self._drop(req)

    def generated(self, req: SimRequest) -> int:
        """Output tokens `req` has so far."""
        if req.state == DECODE:
            return req.generated + self._steps - req.start
        return req.generated

    def generated_inflight(self) -> int:
        """Output tokens of all requests not finished yet (what a gateway has seen stream back from them)."""
        return self._gen_base + self._n_dec * self._steps + self._gen_other

    @property
    def num_running(self) -> int:
        return len(self.running)

    def streams_besides(self, rid: int) -> int:
        """Streamed requests decoding now, request `rid` left out: the streams its API server is sending."""
        return len(self._streams) - (rid in self._streams)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache (held by running requests or evictable)."""
        return len(self._cached) + len(self._evictable)

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.config.num_gpu_blocks

    def outstanding_tokens(self) -> int:
        """Prompt tokens not yet prefilled plus output tokens not yet generated, over all requests here."""
        total = 0
        for req in itertools.chain(self.waiting, self.running.values()):
            total += req.max_tokens - self.generated(req)
            if req.first_token_at is None:
                total += req.prompt_tokens
        return total

    # -- scheduling ---------------------------------------------------------------------------------------
    def _kick(self) -> None:
        if not self._busy and not self._kicked:
            self._kicked = True
            self.clock.call_at(self.clock.now(), self._step)  # after the other events of this instant

    def _step(self) -> None:
        self._kicked = False
        if self._arrived:
            now = self.clock.now()
            for req in self._arrived:
                req.queued_at = now
            self._arrived.clear()
        for req in self._aborts:
            if req.state not in (FINISHED, ABORTED):
                self._drop(req)
        self._aborts.clear()
        if self.config.chunked_prefill:
            self._schedule_chunked()
        else:
            self._schedule_v0()
        seqs = (self._n_dec if self._decode else 0) + len(self._chunks)
        if not seqs:
            self._busy = False
            return
        self._busy = True
        self.steps_total += 1
        self.max_blocks_used = max(self.max_blocks_used, self.used_blocks)
        if self.host_on_device:
            self.device.submit(self.steptime.host_s(seqs) + self._device_s(), self._complete)
            return
        self.clock.call_at(self.clock.now() + self.steptime.host_s(seqs), self._launch, self._device_s())

    def _device_s(self) -> float:
        tokens = sampled = 0
        kv_read = attn = decode_kv = 0.0
        if self._decode:
            decode_kv = self._len_base + self._n_dec * self._steps
            tokens = sampled = self._n_dec
            kv_read = attn = decode_kv
        for req, done, chunk in self._chunks:
            tokens += chunk
            kv_read += done
            attn += ((done + chunk) ** 2 - done * done) / 2
            sampled += done + chunk == req.target
        self.iteration_tokens_total += tokens  # the step's tokens, counted once: here, where they are summed
        return self.steptime.device_s(tokens, sampled, kv_read, attn, decode_kv)

    def _launch(self, device_s: float) -> None:
        self.device.submit(device_s, self._complete)

    def _schedule_v0(self) -> None:
        self._chunks = self._admit(self.config.max_num_batched_tokens, whole=True)
        self._decode = False
        if not self._chunks and self._n_dec:
            self._reserve_decode_blocks()
            self._decode = self._n_dec > 0

    def _schedule_chunked(self) -> None:
        budget = self.config.max_num_batched_tokens
        self._chunks = []
        if self._n_dec:
            self._reserve_decode_blocks()
            budget -= self._n_dec
        self._decode = self._n_dec > 0
        for req in self.prefilling:
            if budget <= 0:
                break
            chunk = min(req.target - req.prefilled, budget, self._room(req.prefilled))
            if chunk > 0:
                self._allocate(_blocks(req.prefilled + chunk, self._bs) - _blocks(req.prefilled, self._bs))
                self._chunks.append((req, req.prefilled, chunk))
                budget -= chunk
        if budget > 0:
            self._chunks += self._admit(budget, whole=False)
        if not self._chunks and not self._decode and self.prefilling:
            self._preempt(self._last_running())  # every block is held by stuck prefills: free the newest
            self._schedule_chunked()

    def _room(self, have: int) -> int:
        """Tokens a sequence holding `have` tokens can add in the blocks it has and the free ones."""
        free = self.config.num_gpu_blocks - self.used_blocks
        return (_blocks(have, self._bs) + free) * self._bs - have

    def _admit(self, budget: int, whole: bool) -> list[tuple[SimRequest, int, int]]:
        """Move waiting requests (FCFS) into the batch while the token budget, batch cap and blocks allow."""
        chunks: list[tuple[SimRequest, int, int]] = []
        cfg = self.config
        free = cfg.num_gpu_blocks - self.used_blocks - cfg.watermark_blocks
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            target = req.prompt_tokens + req.generated
            hits, revived = self._lookup(req, target) if self._apc and req.blocks else (0, 0)
            cached = hits * self._bs
            chunk = target - cached if whole else min(target - cached, budget)
            need = _blocks(cached + chunk, self._bs) - hits + revived
            if chunk > budget or need > free:
                break
            self.waiting.popleft()
            free -= need
            budget -= chunk
            if self._apc:
                self._take_hits(req, hits, target)
            self._allocate(need - revived)
            req.state, req.prefilled, req.target = PREFILL, cached, target
            if req.scheduled_at is None:
                req.scheduled_at = self.clock.now()
            self.running[req.rid] = req
            if not whole:
                self.prefilling.append(req)
            chunks.append((req, cached, chunk))
        return chunks

    # -- prefix caching -----------------------------------------------------------------------------------
    def _lookup(self, req: SimRequest, target: int) -> tuple[int, int]:
        """Leading blocks of `req` in the cache (at most up to its last token), and how many are evictable."""
        blocks, cached, evictable = req.blocks, self._cached, self._evictable
        assert blocks is not None
        limit = min(len(blocks), (target - 1) // self._bs)
        hits = revived = 0
        while hits < limit:
            h = blocks[hits]
            if h in evictable:
                revived += 1
            elif h not in cached:
                break
            hits += 1
        return hits, revived

    def _take_hits(self, req: SimRequest, hits: int, target: int) -> None:
        """Hold the `hits` leading cached blocks (an evictable one comes back into use); count the lookup."""
        blocks = req.blocks or ()
        for h in blocks[:hits]:
            self._hold(h)
        req.refs = list(blocks[:hits])
        req.cached_tokens += hits * self._bs
        if blocks:
            self.prefix_cache_queries += target
            self.prefix_cache_hits += hits * self._bs

    def _hold(self, h: int) -> None:
        if h in self._cached:
            self._cached[h] += 1
        else:
            del self._evictable[h]
            self._cached[h] = 1
            self.used_blocks += 1

    def _allocate(self, blocks: int) -> None:
        """Take `blocks` free blocks, evicting the oldest cached ones when the empty ones run out."""
        self.used_blocks += blocks
        if self._apc:
            evictable = self._evictable
            for _ in range(self.used_blocks + len(evictable) - self.config.num_gpu_blocks):
                evictable.popitem(last=False)

    def _register(self, req: SimRequest, tokens: int) -> None:
        """Enter `req`'s full blocks within its first `tokens` tokens into the cache (it holds them from now on)."""
        if not self._apc or not req.blocks:
            return
        for i in range(len(req.refs), min(len(req.blocks), tokens // self._bs)):
            h = req.blocks[i]
            if h in self._cached or h in self._evictable:
                self._hold(h)  # computed twice at once: keep the cached copy, free this one
                self.used_blocks -= 1
            else:
                self._cached[h] = 1
            req.refs.append(h)

    def _free(self, req: SimRequest, blocks: int, computed: int) -> None:
        """Free the `blocks` blocks `req` holds; the full blocks of its first `computed` tokens stay cached."""
        self._register(req, computed)
        self.used_blocks -= blocks - len(req.refs)
        cached, evictable = self._cached, self._evictable
        for h in reversed(req.refs):  # the tail is evicted first, as vLLM frees blocks in reverse
            if cached[h] > 1:
                cached[h] -= 1
            else:
                del cached[h]
                evictable[h] = None
                self.used_blocks -= 1
        req.refs = []

    def _reserve_decode_blocks(self) -> None:
        """Blocks for every decoding sequence that crosses a block boundary this step; preempt until they fit."""
        while self._n_dec:
            need = self._phase[(1 - self._steps) % self._bs]
            if need <= self.config.num_gpu_blocks - self.used_blocks:
                self._allocate(need)
                return
            self._preempt(self._last_running())

    def _last_running(self) -> SimRequest:
        return self.running[next(reversed(self.running))]

    # -- applying a step ----------------------------------------------------------------------------------
    def _complete(self) -> None:
        now = self.clock.now()
        if self._decode:
            self._steps += 1
            self.generation_tokens_total += self._n_dec
            if self._streams:
                for req in list(self._streams.values()):
                    req.on_token(req, 1)  # type: ignore[misc]
            heap = self._finish
            while heap and heap[0][0] <= self._steps:
                _, epoch, _, req = heapq.heappop(heap)
                if req.epoch == epoch and req.state == DECODE:
                    self._leave_decode(req)
                    self._end(req, FINISHED, now)
        for req, done, chunk in self._chunks:
            if req.state != PREFILL:
                continue
            req.prefilled = done + chunk
            self.prompt_tokens_total += chunk
            if req.prefilled < req.target:
                continue
            if req in self.prefilling:
                self.prefilling.remove(req)
            self._register(req, req.target)
            self._gen_other -= req.generated
            req.generated += 1
            self.generation_tokens_total += 1
            first = req.first_token_at is None
            if first:
                req.first_token_at = now
                self.prompt_tokens_received += req.prompt_tokens
                self.prompt_tokens_cached += min(req.cached_tokens, req.prompt_tokens)
            if req.generated >= req.max_tokens:
                self._free(req, _blocks(req.target, self._bs), req.target)
                self._end(req, FINISHED, now, first_token=first)
                continue
            self._enter_decode(req)
            if first and req.on_first_token is not None:
                req.on_first_token(req)
            if req.on_token is not None:
                req.on_token(req, 1)
        self._chunks = []
        self._busy = False
        if self.waiting or self.running or self._aborts:
            self._kicked = True
            self._step()

    def _enter_decode(self, req: SimRequest) -> None:
        req.state = DECODE
        req.start = self._steps
        req.c0 = req.prompt_tokens + req.generated
        req.epoch += 1
        self._n_dec += 1
        self._len_base += req.c0 - req.start
        self._gen_base += req.generated - req.start
        self._phase[(req.c0 - req.start) % self._bs] += 1
        heapq.heappush(self._finish, (req.start + req.max_tokens - req.generated, req.epoch, req.rid, req))
        if req.on_token is not None:
            self._streams[req.rid] = req

    def _leave_decode(self, req: SimRequest) -> None:
        """Take `req` out of the decode aggregates, fix its own counts, and free its blocks."""
        self._n_dec -= 1
        self._len_base -= req.c0 - req.start
        self._gen_base -= req.generated - req.start
        req.generated += self._steps - req.start
        self._phase[(req.c0 - req.start) % self._bs] -= 1
        req.epoch += 1
        self._streams.pop(req.rid, None)
        computed = req.prompt_tokens + req.generated - 1  # the last token's KV is never written
        self._free(req, _blocks(computed, self._bs), computed)

    def _preempt(self, req: SimRequest) -> None:
        """Recompute preemption: free the request's blocks and put it back at the front of the queue."""
        self._release(req)
        self._gen_other += req.generated
        req.state = WAITING
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: SimRequest) -> None:
        """Take a running request out of the batch and free its blocks."""
        if req.state == DECODE:
            self._leave_decode(req)
        else:
            chunked = self.config.chunked_prefill
            self._free(req, _blocks(req.prefilled if chunked else req.target, self._bs),
                       req.prefilled if chunked else 0)
            self._gen_other -= req.generated
            if req in self.prefilling:
                self.prefilling.remove(req)
        del self.running[req.rid]

    def _drop(self, req: SimRequest) -> None:
        self._release(req)
        self._end(req, ABORTED)

    def _end(self, req: SimRequest, state: str, now: float | None = None, first_token: bool = False) -> None:
        if req.state in (PREFILL, DECODE) and req.rid in self.running:
            del self.running[req.rid]
        req.state = state
        req.finished_at = self.clock.now() if now is None else now
        if state == FINISHED:
            self.finished_total += 1
            if req.queued_at is not None and req.scheduled_at is not None and req.first_token_at is not None:
                self.queue_time[0] += req.scheduled_at - req.queued_at
                self.queue_time[1] += 1
                self.prefill_time[0] += req.first_token_at - req.scheduled_at
                self.prefill_time[1] += 1
            if first_token and req.on_first_token is not None:
                req.on_first_token(req)
            if req.on_token is not None and first_token:
                req.on_token(req, 1)
        if req.on_finish is not None:
            req.on_finish(req)
