"""LoRA adapters on demand: route a request naming an adapter to a replica that holds it, else load it there.

Off unless the config registers adapters (`lora.adapters`: name -> path or repository). Only those names are
ever loaded, from the registered path: a client's string is only looked up, never used as a path. A request
whose `model` is a registered adapter goes through `AdapterRouter.acquire` instead of the router's own:

- the policy picks the best replica among those serving the adapter's base; a replica that holds the adapter
  wins instead while it is within the load bound of the best: its estimated time to first token within the
  policy's eligibility bound of the best's plus the time a load takes (measured, `load_s`: a load elsewhere
  would cost that much), and its outstanding tokens at most `slack_tokens` above the best's (so one popular
  adapter does not pile onto one replica while its batch still has room);
- otherwise the adapter is loaded on the best (`/v1/load_lora_adapter`). When the replica already holds
  `max_loras` adapters, the least recently used one with no request in flight is unloaded first
  (`/v1/unload_lora_adapter`); with every one busy the load waits for one to free, up to `load_timeout_s`;
- concurrent requests for an adapter being loaded on a replica wait for that one load (single flight), up to
  `load_timeout_s`; a failed load answers each of them 502 naming the adapter, a slow one 504.

Loads and unloads on one replica take its lock file (`ReplicaLocks`, in the temporary directory): one process at a
time counts the replica's adapters (a fresh `/v1/models`), unloads and loads, so `max_loras` holds across workers
and across gateways on one machine. What each replica holds is shared by every worker process, like the metrics: each worker writes cells of its
own row only (`lora_held`: +time loaded, -time unloaded, the latest event wins; `lora_inflight`; `lora_used`)
and reads the sum or the latest over all rows. It is learned from the gateway's own loads and unloads and from
each replica's `/v1/models` (vLLM lists loaded adapters with their `parent`), read every `sync_s` and before
every load; a load or unload that vLLM says was already done (another worker, another gateway) counts as done.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Protocol

import aiohttp

from .config import AdapterSpec, GatewayConfig, LoraConfig
from .errors import GatewayError
from .metrics import CounterStore, LabelledCounter, RegionReader
from .parsing import RequestInfo
from .policies import EstimatedTtft, Policy
from .replicas import Lease, Replica
from .router import Router

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.02  # while waiting for a free adapter slot or a free batch slot: how often to look again
LOAD_REASON_S = 0.2  # how long past its deadline a request waits for the loader to say why it gave up
LOAD_S_INITIAL = 1.0  # the expected time of one load before any was measured
LOAD_S_WEIGHT = 0.3  # the weight of the newest load in the moving average


class AdapterError(Exception):
    """A replica refused or failed an adapter load or unload."""


class AdapterApi(Protocol):
    """vLLM's adapter endpoints on one replica."""

    async def listed(self, url: str) -> set[str]:
        """The adapters the replica holds now (its /v1/models entries with a parent)."""
        ...

    async def load(self, url: str, name: str, path: str) -> bool:
        """Load the adapter: True, or False when it was loaded already (by another worker or gateway)."""
        ...

    async def unload(self, url: str, name: str) -> None:
        """Unload the adapter (not there counts as done)."""
        ...


class VllmAdapterApi:
    """`AdapterApi` over HTTP, with explicit timeouts."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float, headers: dict[str, str]) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = headers

    async def listed(self, url: str) -> set[str]:
        try:
            async with self._session.get(f"{url}/v1/models", timeout=self._timeout, headers=self._headers) as resp:
                body = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise AdapterError(f"cannot list the adapters of {url}: {exc!r}") from None
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise AdapterError(f"{url}/v1/models did not answer a model list")
        return {m["id"] for m in body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent")}

    async def load(self, url: str, name: str, path: str) -> bool:
        status, text = await self._post(f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if status == 400 and "already been loaded" in text:
            return False
        if status != 200:
            raise AdapterError(f"replica {url} could not load adapter {name!r}: {status} {text[:300]}")
        return True

    async def unload(self, url: str, name: str) -> None:
        status, text = await self._post(f"{url}/v1/unload_lora_adapter", {"lora_name": name})
        if status not in (200, 404):
            raise AdapterError(f"replica {url} could not unload adapter {name!r}: {status} {text[:300]}")

    async def _post(self, url: str, body: dict[str, str]) -> tuple[int, str]:
        try:
            async with self._session.post(url, json=body, timeout=self._timeout, headers=self._headers) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AdapterError(f"{url} failed: {exc!r}") from None


class SharedHoldings:
    """Which replica holds which adapter, its requests in flight and its last use: shared by every worker.

    Each worker writes only its own metric region's cells; reads take the latest event (held) or the sum
    (in flight) or the latest time (used) over every region.
    """

    def __init__(self, store: CounterStore, regions: Callable[[], Iterable[memoryview]]) -> None:
        self._store = store
        self._values = store.values
        self._regions = regions
        self._reader = RegionReader()
        self._cells: dict[tuple[str, ...], int] = {}

    def _cell(self, key: tuple[str, ...]) -> int:
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = self._store.cell(key)
        return cell

    def forget_inflight(self, urls: Iterable[str], names: Iterable[str]) -> None:
        """Zero this worker's in-flight cells (a restarted worker's predecessor's requests are gone)."""
        for url in urls:
            for name in names:
                self._values[self._cell(("lora_inflight", url, name))] = 0.0

    def held(self, url: str, name: str) -> bool:
        latest = max(self._reader.values(self._regions(), ("lora_held", url, name)), key=abs, default=0.0)
        return latest > 0

    def set_held(self, url: str, name: str, held: bool, at: float) -> None:
        """An event at wall-clock time `at`: loaded (held) or unloaded; an older event changes nothing."""
        cell = self._cell(("lora_held", url, name))
        if at >= abs(self._values[cell]):
            self._values[cell] = at if held else -at

    def inflight(self, url: str, name: str) -> int:
        return round(sum(self._reader.values(self._regions(), ("lora_inflight", url, name))))

    def add_inflight(self, url: str, name: str, delta: int) -> None:
        self._values[self._cell(("lora_inflight", url, name))] += delta
        if delta > 0:
            self._values[self._cell(("lora_used", url, name))] = time.time()

    def last_used(self, url: str, name: str) -> float:
        return max(self._reader.values(self._regions(), ("lora_used", url, name)), default=0.0)


class ReplicaLocks:
    """A lock file per replica: its adapters are counted, unloaded and loaded by one process at a time (every
    worker and every gateway on this machine), so two workers cannot both fill its last slot."""

    def __init__(self, directory: Path | None = None) -> None:
        self._dir = directory or Path(tempfile.gettempdir()) / "smallserve-lora-locks"

    @contextlib.asynccontextmanager
    async def hold(self, url: str, deadline: float) -> AsyncIterator[None]:
        """Hold the replica's lock (polling: flock has no timeout); TimeoutError past `deadline`."""
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self._dir / f"{hashlib.sha256(url.encode()).hexdigest()[:24]}.lock", os.O_RDWR | os.O_CREAT,
                     0o600)
        try:
            loop = asyncio.get_running_loop()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if loop.time() >= deadline:
                        raise TimeoutError(f"another process held the adapter lock of {url} too long") from None
                    await asyncio.sleep(WAIT_POLL_S)
            yield
        finally:
            os.close(fd)  # releases the lock


class AdapterLease(Lease):
    """A lease that also holds its request's count in flight on its adapter (taken when the replica was chosen,
    so the adapter is never unloaded under it), given back on release."""

    __slots__ = ("_holdings", "_adapter", "_counted")

    def __init__(self, replica: Replica, info: RequestInfo, on_release: Callable[[], None],
                 holdings: SharedHoldings) -> None:
        super().__init__(replica, info, on_release)
        self._holdings, self._adapter, self._counted = holdings, info.model, True

    def release(self) -> None:
        if self._counted:
            self._counted = False
            self._holdings.add_inflight(self.replica.url, self._adapter, -1)
        super().release()


class AdapterRouter:
    """Places requests for registered adapters (see the module docstring); one per worker process."""

    def __init__(self, config: LoraConfig, router: Router, policy: Policy, api: AdapterApi,
                 holdings: SharedHoldings, store: CounterStore, locks: ReplicaLocks | None = None) -> None:
        self.config = config
        self.registry = config.registry()
        self._router = router
        self._policy = policy
        self._api = api
        self.holdings = holdings
        self._loads = LabelledCounter(store, "lora_loads")
        self._unloads = LabelledCounter(store, "lora_unloads")
        self._failures = LabelledCounter(store, "lora_load_failures")
        self._flights: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._replica_locks: dict[str, asyncio.Lock] = {}
        self._file_locks = locks or ReplicaLocks()
        self._tasks: set[asyncio.Task[None]] = set()
        self.load_s = LOAD_S_INITIAL

    # -- choosing ---------------------------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        """Registered adapters exist for the gateway even while no replica holds them; others as usual."""
        if model not in self.registry:
            self._router.check_model(model)

    def candidates(self, spec: AdapterSpec, exclude: frozenset[str]) -> list[Replica]:
        return [r for r in self._router.replicas.values()
                if r.healthy and not r.draining and r.url not in exclude and (spec.base is None or spec.base in r.models)]

    def choose(self, spec: AdapterSpec, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Replica:
        """A replica holding the adapter while it is near the best replica (by the load bound); else the best."""
        candidates = self.candidates(spec, exclude)
        if not candidates:
            reason = "every replica failed" if exclude else "no healthy replica"
            raise GatewayError(503, f"{reason} for adapter `{spec.name}`; try again shortly",
                               code="no_replica_available", headers={"Retry-After": "1"})
        cost = info.cost
        for replica in candidates:
            replica.refresh()
        open_ = [r for r in candidates if r.has_room(cost)] or candidates
        best = self._policy.pick(open_, info)
        holders = [r for r in open_ if self.holdings.held(r.url, spec.name)]
        if not holders or best in holders:
            return best
        estimate, prompt = EstimatedTtft.estimate, info.prompt_tokens
        limit = EstimatedTtft().bound(estimate(best, prompt), best) + self.load_s
        slack = self.config.slack_tokens + best.outstanding / best.weight
        near = [r for r in holders if estimate(r, prompt) <= limit and r.outstanding / r.weight <= slack]
        return min(near, key=lambda r: estimate(r, prompt)) if near else best

    # -- a lease ----------------------------------------------------------------------------------------------
    async def acquire(self, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Lease:
        """A lease on a replica that holds the adapter, loading it first where need be (bounded in time)."""
        spec = self.registry[info.model]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.load_timeout_s
        replica = self.choose(spec, info, exclude)
        # In flight from the choice on (no await in between): a request waiting for its adapter's load, or for room,
        # keeps the adapter from being unloaded meanwhile (by this worker or another); the lease takes it over.
        self.holdings.add_inflight(replica.url, spec.name, 1)
        made: list[AdapterLease] = []

        def make(chosen: Replica) -> AdapterLease:
            made.append(AdapterLease(chosen, info, self._router.wake, self.holdings))
            return made[-1]
        try:
            if not self.holdings.held(replica.url, spec.name):
                await self.ensure(replica, spec, deadline)
            # Room on that replica, through the router's admission queue: in its order (priority, the tenant's
            # virtual token counter) among every waiting request, charged and settled as the router's leases are.
            return await self._router.acquire_on(replica, info, make)
        except BaseException:
            if not made:  # else the lease took the count over, and gave it back when it was released unused
                self.holdings.add_inflight(replica.url, spec.name, -1)
            raise

    async def ensure(self, replica: Replica, spec: AdapterSpec, deadline: float) -> None:
        """The adapter loaded on the replica: one load however many requests wait for it."""
        key = (replica.url, spec.name)
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._load(replica, spec, deadline, flight), name=f"lora-load-{spec.name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # a little past the loader's own deadline: when it gives up it says why (every slot busy, a refusal)
        timeout = max(0.0, deadline - asyncio.get_running_loop().time()) + LOAD_REASON_S
        try:
            await asyncio.wait_for(asyncio.shield(flight), timeout)
        except TimeoutError:
            raise GatewayError(504, f"adapter `{spec.name}` was not loaded on {replica.url} within "
                               f"{self.config.load_timeout_s:g} s", code="adapter_load_timeout") from None
        except AdapterError as exc:
            raise GatewayError(502, f"loading adapter `{spec.name}` failed: {exc}", code="adapter_load_failed") from None

    async def _load(self, replica: Replica, spec: AdapterSpec, deadline: float, flight: asyncio.Future[None]) -> None:
        url = replica.url
        try:
            lock = self._replica_locks.setdefault(url, asyncio.Lock())
            loop = asyncio.get_running_loop()
            # Slots are counted, then used, one load at a time; but the locks are let go while every slot is busy:
            # a request waiting on another load (of an adapter the replica lists, say, and counted in flight on it)
            # would otherwise keep the slot this load waits for, and this load the lock that request waits for.
            while True:
                async with lock, self._file_locks.hold(url, deadline):
                    if await self._make_room_and_load(url, spec, deadline):
                        break
                if loop.time() >= deadline:
                    raise AdapterError(f"all {self.config.max_loras} adapter slots of {url} are busy")
                await asyncio.sleep(WAIT_POLL_S)
        except (AdapterError, TimeoutError, OSError) as exc:
            self._failures.labels(url, spec.name).inc()
            logger.warning("loading adapter %s on %s failed: %s", spec.name, url, exc)
            if not flight.done():
                flight.set_exception(exc if isinstance(exc, AdapterError) else AdapterError(str(exc) or "timed out"))
                # (OSError: the lock file could not be opened, e.g. no descriptor left)
                flight.exception()  # retrieved: waiters that timed out already do not warn about it
        else:
            if not flight.done():
                flight.set_result(None)
        finally:
            self._flights.pop((url, spec.name), None)
            if not flight.done():  # cancelled: the gateway is stopping
                flight.set_exception(AdapterError("the gateway stopped while loading"))
                flight.exception()

    async def _make_room_and_load(self, url: str, spec: AdapterSpec, deadline: float) -> bool:
        """Load the adapter, unloading idle ones to make room; False (nothing loaded) while every slot is busy."""
        loop = asyncio.get_running_loop()
        listed = await self.sync(url)
        if spec.name in listed:
            return True
        while len(listed) >= self.config.max_loras:
            victim = self._victim(url, listed)
            if victim is None:
                return False
            # no longer a holder from here on, before any await: no request of this worker can pick it meanwhile
            self.holdings.set_held(url, victim, False, time.time())
            await self._api.unload(url, victim)
            self._unloads.labels(url, victim).inc()
            logger.info("unloaded adapter %s from %s (least recently used)", victim, url)
            listed.discard(victim)
        started = loop.time()
        loaded = await asyncio.wait_for(self._api.load(url, spec.name, spec.path), max(0.001, deadline - started))
        self.holdings.set_held(url, spec.name, True, time.time())
        if not loaded:
            return True
        self._loads.labels(url, spec.name).inc()
        took = loop.time() - started
        self.load_s = (1 - LOAD_S_WEIGHT) * self.load_s + LOAD_S_WEIGHT * took
        logger.info("loaded adapter %s on %s in %.2f s", spec.name, url, took)
        return True

    def _victim(self, url: str, listed: set[str]) -> str | None:
        """The least recently used adapter with no request in flight and no load of it under way, if any."""
        idle = [n for n in listed if self.holdings.inflight(url, n) <= 0 and (url, n) not in self._flights]
        return min(idle, key=lambda n: (self.holdings.last_used(url, n), n)) if idle else None

    # -- what the replicas hold -------------------------------------------------------------------------------
    def lost(self, url: str, name: str) -> None:
        """The replica answered 404 for `name`, which the gateway counted as loaded there: it restarted (or was
        told to unload it) since its list was last read. The next request for it there loads it again."""
        self.holdings.set_held(url, name, False, time.time())
        logger.warning("replica %s no longer holds adapter %s (restarted?); loading it again", url, name)

    async def sync(self, url: str) -> set[str]:
        """Read what the replica holds now and record it (events since the read began win over it)."""
        at = time.time()
        listed = await self._api.listed(url)
        for name in self.registry.keys() | listed:
            self.holdings.set_held(url, name, name in listed, at)
        return listed

    async def run(self) -> None:
        """Read every healthy replica's adapters every `sync_s`."""
        while True:
            for replica in [r for r in self._router.replicas.values() if r.healthy]:
                try:
                    await self.sync(replica.url)
                except AdapterError as exc:
                    logger.debug("adapter sync: %s", exc)
            await asyncio.sleep(self.config.sync_s)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            try:
                await task
            except asyncio.CancelledError:
                pass


def upstream_headers(config: GatewayConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.upstream_api_key}"} if config.upstream_api_key else {}
