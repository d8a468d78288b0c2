"""Connections the gateway holds: slow clients give way at the connection cap; idle replica connections retire.

Raw sockets play the slow clients; the cap test runs the real `gateway serve` under `ulimit -n 256` in a subprocess
(tests/test_gateway_security.py's `gateway_process`), in front of an in-process FAKE replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil

from gateway.server import Deadlines, HttpServer
from gateway.upstream import Origin, UpstreamPool
from tests.conftest import FakeFactory, until
from tests.test_gateway_http import Echo, connect, read_eof, read_reply
from tests.test_gateway_security import assert_openai_error, gateway_process, trickle

GET = b"GET %b HTTP/1.1\r\nHost: t\r\n\r\n"
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Pad: " + b"p" * 200


@contextlib.asynccontextmanager
async def capped(max_connections: int, shed_s: float, echo: Echo) -> AsyncIterator[tuple[int, list[None]]]:
    """An HTTP server with `max_connections` and `shed_s`; yields its port and a list that grows by one per shed."""
    shed: list[None] = []
    server = HttpServer(echo, 1024, deadlines=Deadlines(shed_s=shed_s), max_connections=max_connections,
                        on_shed=lambda: shed.append(None))
    port = await server.start("127.0.0.1", 0)
    try:
        yield port, shed
    finally:
        await server.close(0)
        await asyncio.sleep(0.01)


async def test_at_the_cap_the_oldest_connection_without_a_request_head_gives_way() -> None:
    """At the cap a new connection is refused 503 while the connections without a request head are young; once
    the oldest has had shed_s, it is answered 408 and closed, and the new connection is served. The next oldest,
    half-way through its head, stays and is served when its head is done."""
    echo = Echo()
    async with (capped(2, 1.0, echo) as (port, shed), connect(port) as (silent_r, _silent_w),
                connect(port) as (slow_r, slow_w)):
        slow_w.write(b"GET /slow HT")
        async with connect(port) as (early_r, early_w):
            early_w.write(GET % b"/early")
            early = await read_reply(early_r)
        await asyncio.sleep(1.1)
        async with connect(port) as (new_r, new_w):
            new_w.write(GET % b"/new")
            served = await read_reply(new_r)
        gone = await read_reply(silent_r)
        assert await read_eof(silent_r) == b""
        slow_w.write(b"TP/1.1\r\nHost: t\r\n\r\n")
        slow = await read_reply(slow_r)
    assert early.status == 503 and early.headers["retry-after"] == "1"
    assert served.status == 200 and json.loads(served.body)["path"] == "/new"
    assert gone.status == 408 and gone.headers["connection"] == "close"
    assert "connection limit" in assert_openai_error(gone.body, 408)["message"]
    assert slow.status == 200 and json.loads(slow.body)["path"] == "/slow"
    assert len(shed) == 1


async def test_connections_answering_or_idle_between_requests_are_never_shed() -> None:
    """A connection whose request is being answered, and one idle between keep-alive requests, keep their room
    at the cap however long they take: a new connection is refused 503 instead."""
    echo = Echo(delays={"/busy": 1.0})
    async with (capped(2, 0.1, echo) as (port, shed), connect(port) as (busy_r, busy_w),
                connect(port) as (idle_r, idle_w)):
        busy_w.write(GET % b"/busy")
        idle_w.write(GET % b"/first")
        assert (await read_reply(idle_r)).status == 200
        await asyncio.sleep(0.3)
        async with connect(port) as (new_r, new_w):
            new_w.write(GET % b"/new")
            refused = await read_reply(new_r)
        busy = await read_reply(busy_r)
        idle_w.write(GET % b"/second")
        again = await read_reply(idle_r)
    assert refused.status == 503
    assert busy.status == 200 and again.status == 200
    assert shed == []


async def test_trickling_connections_cannot_hold_the_cap_under_ulimit_256(
        fake_replica: FakeFactory, tmp_path: Path) -> None:
    """The issue's case: `gateway serve` under `ulimit -n 256` (a cap of 96 connections), 150 connections each
    trickling a request head (a byte every 0.5 s, never done), then 20 ordinary requests: all 200, long before the
    trickles' own 20 s head deadline; the slow ones shed are counted in /metrics."""
    fake = await fake_replica()
    async with gateway_process(tmp_path, fake.url, 256, 256) as (url, proc, log):
        port = int(url.rsplit(":", 1)[1])
        streams = [await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5) for _ in range(150)]
        trickles = [asyncio.create_task(trickle(writer, SLOW_HEAD, 0.5)) for _, writer in streams]
        try:
            await asyncio.sleep(0.3)
            started = time.monotonic()
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=15)) as session:
                async def ordinary() -> int:
                    async with session.post(url + "/v1/completions",
                                            json={"model": "fake-model", "prompt": "x", "max_tokens": 4}) as resp:
                        await resp.read()
                        return resp.status
                statuses = await asyncio.gather(*(ordinary() for _ in range(20)))
                took = time.monotonic() - started
                async with session.get(url + "/metrics") as resp:
                    metrics = await resp.text()
            assert proc.poll() is None
        finally:
            for task in trickles:
                task.cancel()
            await asyncio.gather(*trickles, return_exceptions=True)
            for _, writer in streams:
                writer.close()
    assert statuses == [200] * 20
    assert took < 10, took  # the trickles hold their heads for 20 s: the ordinary requests did not wait for that
    found = re.search(r'gateway_connections_shed_total\{reason="no_request_head"\} (\S+)', metrics)
    assert found and float(found.group(1)) >= 20, metrics
    text = log.read_text()
    assert "accepting up to 96 client connections" in text and "Traceback" not in text


def replica_sockets(port: int) -> int:
    """This process's established TCP connections to `port`."""
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


async def test_idle_replica_connections_close_after_idle_s_without_another_request(fake_replica: FakeFactory) -> None:
    """Against a replica that keeps connections alive (aiohttp: 75 s), the pool's idle connections close once
    idle_s has passed, with no request to take them; the timer stops with the pool."""
    fake = await fake_replica()
    origin = Origin.from_url(fake.url)
    pool = UpstreamPool(connect_s=2, idle_s=1.0)
    head = b"GET /v1/models HTTP/1.1\r\nHost: %b\r\n\r\n" % origin.host_header

    async def one() -> None:
        response = await asyncio.wait_for(pool.request(origin, head, b""), 5)
        await asyncio.wait_for(response.read(), 5)
        response.close()
    await asyncio.gather(*(one() for _ in range(5)))
    assert replica_sockets(origin.port) == 5
    await asyncio.sleep(0.5)
    await one()  # reuses one: it is idle from now, the other four from before
    await until(lambda: replica_sockets(origin.port) == 1, 1.0)
    assert replica_sockets(origin.port) == 1
    await until(lambda: replica_sockets(origin.port) == 0, 2.0)
    assert replica_sockets(origin.port) == 0
    pool.close()
    assert pool._reaper is None
