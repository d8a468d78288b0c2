"""The admin API (/admin/replicas) and config reload on SIGHUP, in front of FAKE replicas."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from deploy.ports import free_ports
from tests.conftest import FakeFactory, GatewayFactory, GatewayUnderTest
from tests.test_gateway_workers import ServeFactory, _wait, serve, short  # noqa: F401  (serve: fixture)

ADMIN = "sk-admin-test"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
SHORT = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
ROOT = Path(__file__).resolve().parent.parent


async def call(session: aiohttp.ClientSession, method: str, url: str, json: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with session.request(method, url, json=json, headers=AUTH if headers is None else headers) as resp:
        return resp.status, await resp.json(content_type=None)


def error_code(body: Any) -> str:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return str(body["error"]["code"])


async def served_by(session: aiohttp.ClientSession, gw: GatewayUnderTest, n: int = 8) -> set[str]:
    replicas = set()
    for _ in range(n):
        async with session.post(gw.base_url + "/completions", json=SHORT) as resp:
            assert resp.status == 200, await resp.text()
            replicas.add(resp.headers["x-gateway-replica"])
    return replicas


async def test_admin_api_is_off_without_an_admin_key(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """No admin_key configured: /admin/replicas is a 404 like any unknown path, whatever key is sent."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url])
    async with aiohttp.ClientSession() as session:
        status, body = await call(session, "GET", gw.url + "/admin/replicas")
    assert status == 404 and error_code(body) == "not_found"


async def test_admin_key_is_required_and_client_keys_are_refused(fake_replica: FakeFactory,
                                                                  gateway_for: GatewayFactory) -> None:
    """No key or a wrong one: 401; a client API key: 403; the admin key: 200 (and it is no client key)."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], admin_key=ADMIN, api_keys=["sk-client"])
    url = gw.url + "/admin/replicas"
    async with aiohttp.ClientSession() as session:
        assert (await call(session, "GET", url, headers={}))[0] == 401
        status, body = await call(session, "GET", url, headers={"Authorization": "Bearer nope"})
        assert status == 401 and error_code(body) == "invalid_api_key"
        status, body = await call(session, "GET", url, headers={"Authorization": "Bearer sk-client"})
        assert status == 403 and error_code(body) == "permission_denied"
        assert (await call(session, "GET", url))[0] == 200
        async with session.post(gw.base_url + "/completions", json=SHORT, headers=AUTH) as resp:
            assert resp.status == 401  # the admin key does not open /v1


async def test_list_get_and_unknown_ids(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Replicas are listed with their ids (name, or host:port), config, health and load; an unknown id is a 404."""
    a, b = await fake_replica(), await fake_replica()
    gw = await gateway_for([{"url": a.url, "name": "alpha", "weight": 2.0, "max_requests": 4}, b.url],
                           admin_key=ADMIN)
    async with aiohttp.ClientSession() as session:
        status, listing = await call(session, "GET", gw.url + "/admin/replicas")
        assert status == 200 and listing["object"] == "list"
        by_id = {r["id"]: r for r in listing["data"]}
        b_id = b.url.removeprefix("http://")
        assert set(by_id) == {"alpha", b_id}
        alpha = by_id["alpha"]
        assert (alpha["url"], alpha["weight"], alpha["max_requests"], alpha["healthy"], alpha["draining"]) == (
            a.url, 2.0, 4, True, False)
        assert alpha["models"] == ["fake-model"] and alpha["inflight_requests"] == 0
        assert (await call(session, "GET", f"{gw.url}/admin/replicas/{b_id}"))[1]["url"] == b.url
        status, body = await call(session, "GET", gw.url + "/admin/replicas/nobody")
        assert status == 404 and error_code(body) == "replica_not_found"
        status, body = await call(session, "PUT", gw.url + "/admin/replicas/alpha")
        assert status == 405 and error_code(body) == "method_not_allowed"


async def test_added_replica_is_probed_and_serves(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """POST adds a replica, healthy in the answer (probed first) and serving at once; the same again is a 409."""
    a, b = await fake_replica(), await fake_replica()
    gw = await gateway_for([a.url], admin_key=ADMIN, policy="least_outstanding_tokens")  # by load alone: under prefix_affinity one repeated prompt keeps one replica
    async with aiohttp.ClientSession() as session:
        status, added = await call(session, "POST", gw.url + "/admin/replicas", {"url": b.url, "name": "b"})
        assert status == 201 and added["healthy"] is True and added["id"] == "b"
        await asyncio.sleep(0.05)  # the request path follows the replica set within 25 ms
        assert await served_by(session, gw) == {a.url, b.url}
        status, body = await call(session, "POST", gw.url + "/admin/replicas", {"url": b.url})
        assert status == 409 and error_code(body) == "replica_exists"


@pytest.mark.parametrize("body", [{}, {"url": "ftp://x"}, {"url": "http://x:1", "weight": -1},
                                  {"url": "http://x:1", "colour": "red"}, {"url": "http://x:1", "name": "a b"}, [1]])
async def test_bad_replicas_are_refused_with_400(fake_replica: FakeFactory, gateway_for: GatewayFactory,
                                                 body: Any) -> None:
    """A replica without a URL, with a bad value or an unknown key is a 400 naming the problem; nothing changes."""
    fake = await fake_replica()
    gw = await gateway_for([fake.url], admin_key=ADMIN)
    async with aiohttp.ClientSession() as session:
        status, error = await call(session, "POST", gw.url + "/admin/replicas", body)
        assert status == 400 and error["error"]["message"]
        assert len((await call(session, "GET", gw.url + "/admin/replicas"))[1]["data"]) == 1


async def test_patch_reweights_and_recaps(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """PATCH changes weight and caps in place; its URL or name cannot change."""
    fake = await fake_replica()
    gw = await gateway_for([{"url": fake.url, "name": "r0"}], admin_key=ADMIN)
    async with aiohttp.ClientSession() as session:
        status, view = await call(session, "PATCH", gw.url + "/admin/replicas/r0", {"weight": 3.0, "max_requests": 7})
        assert status == 200 and (view["weight"], view["max_requests"]) == (3.0, 7)
        await asyncio.sleep(0.05)
        replica = gw.gateway.router.replicas[fake.url]
        assert (replica.weight, replica.max_requests) == (3.0, 7)
        assert (await call(session, "PATCH", gw.url + "/admin/replicas/r0", {"url": "http://x:1"}))[0] == 400
        assert (await call(session, "PATCH", gw.url + "/admin/replicas/r0", {"weight": 0}))[0] == 400


async def test_drained_replica_takes_nothing_new_and_leaves_when_its_requests_are_done(
        fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Drain: a stream in flight there finishes whole, new requests go elsewhere, then the replica leaves the set."""
    a, b = await fake_replica(itl_s=0.02), await fake_replica(itl_s=0.02)
    gw = await gateway_for([{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}], admin_key=ADMIN)
    async with aiohttp.ClientSession() as session:
        stream = await session.post(gw.base_url + "/completions", json={**SHORT, "max_tokens": 50, "stream": True})
        busy = stream.headers["x-gateway-replica"]
        name, other = ("a", b.url) if busy == a.url else ("b", a.url)
        status, view = await call(session, "POST", f"{gw.url}/admin/replicas/{name}/drain")
        assert status == 202 and view["draining"] is True and view["inflight_requests"] == 1
        await asyncio.sleep(0.05)
        assert await served_by(session, gw) == {other}
        assert (await call(session, "GET", f"{gw.url}/admin/replicas/{name}"))[0] == 200  # still finishing
        assert (await stream.text()).count("data: {") == 50
        await _wait(lambda: _gone(session, f"{gw.url}/admin/replicas/{name}"), 3, "the drained replica to leave")
        assert set(gw.gateway.router.replicas) == {other}


async def _gone(session: aiohttp.ClientSession, url: str) -> bool:
    return (await call(session, "GET", url))[0] == 404


async def test_deleted_replica_leaves_at_once_and_its_stream_finishes(fake_replica: FakeFactory,
                                                                      gateway_for: GatewayFactory) -> None:
    """DELETE takes the replica out at once; a stream already on it is not cut."""
    a, b = await fake_replica(itl_s=0.02), await fake_replica(itl_s=0.02)
    gw = await gateway_for([{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}], admin_key=ADMIN)
    async with aiohttp.ClientSession() as session:
        stream = await session.post(gw.base_url + "/completions", json={**SHORT, "max_tokens": 30, "stream": True})
        name, other = ("a", b.url) if stream.headers["x-gateway-replica"] == a.url else ("b", a.url)
        status, view = await call(session, "DELETE", f"{gw.url}/admin/replicas/{name}")
        assert status == 200 and view["removed"] is True
        assert (await call(session, "GET", f"{gw.url}/admin/replicas/{name}"))[0] == 404
        await asyncio.sleep(0.05)
        assert await served_by(session, gw) == {other}
        assert (await stream.text()).count("data: {") == 30


async def test_admin_changes_reach_every_worker(fake_replica: FakeFactory, serve: ServeFactory) -> None:  # noqa: F811
    """With two workers the API (served by the supervisor) adds a replica both workers use, and drains it in both."""
    a, b = await fake_replica(), await fake_replica()
    gw = await serve([a.url], admin_key=ADMIN, policy="least_outstanding_tokens")  # by load alone: under prefix_affinity one repeated prompt keeps one replica
    async with aiohttp.ClientSession() as session:
        status, added = await call(session, "POST", gw.url + "/admin/replicas", {"url": b.url, "name": "b"})
        assert status == 201 and added["healthy"] is True

        async def both_workers_use_b() -> bool:
            seen = [await short(session, gw.url) for _ in range(16)]
            return {w for r, w in seen if r == b.url} == {w for _, w in seen} and len({w for _, w in seen}) == 2
        await _wait(both_workers_use_b, 10, "both workers sending to the added replica")
        assert (await call(session, "POST", gw.url + "/admin/replicas/b/drain"))[0] == 202
        await asyncio.sleep(0.2)
        seen = [await short(session, gw.url) for _ in range(16)]
        assert {r for r, _ in seen} == {a.url} and len({w for _, w in seen}) == 2
        await _wait(lambda: _gone(session, gw.url + "/admin/replicas/b"), 5, "the drained replica to leave")
        status, body = await call(session, "GET", gw.url + "/admin/replicas", headers={})
        assert status == 401 and error_code(body) == "invalid_api_key"


async def test_sighup_reloads_replicas_and_keeps_the_old_config_when_the_new_one_is_bad(
        fake_replica: FakeFactory, tmp_path: Path) -> None:
    """One process: SIGHUP adds, removes and reweights replicas from the file; a bad file changes nothing."""
    a, b, c = await fake_replica(), await fake_replica(), await fake_replica()
    port = free_ports()
    path = tmp_path / "gateway.yaml"
    config = {"host": "127.0.0.1", "port": port, "admin_key": ADMIN, "log_level": "warning",
              "health": {"interval_s": 0.2, "timeout_s": 1},
              "replicas": [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}]}
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)], cwd=ROOT,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/admin/replicas"
    try:
        async with aiohttp.ClientSession() as session:
            async def listing() -> dict[str, Any]:
                return {r["id"]: r for r in (await call(session, "GET", url))[1]["data"]}

            async def all_healthy() -> bool:
                return all(r["healthy"] for r in (await listing()).values())
            await _wait(all_healthy, 20, "the gateway serving")
            config["replicas"] = [{"url": a.url, "name": "a", "weight": 3.0}, {"url": c.url, "name": "c"}]
            path.write_text(yaml.safe_dump(config))
            proc.send_signal(signal.SIGHUP)

            async def reloaded() -> bool:
                now = await listing()
                return set(now) == {"a", "c"} and now["a"]["weight"] == 3.0
            await _wait(reloaded, 5, "the new replicas, the new weight")
            path.write_text("replicas: [not a url]\n")
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.5)
            assert set(await listing()) == {"a", "c"} and proc.poll() is None
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=SHORT) as resp:
                assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert b"not valid, keeping the old one" in err
