"""prefix_affinity's placement rules: a completions head counts once it recurs; a chat's first turn goes where its
later turns will look for its cache."""

from __future__ import annotations

import json
import random
from typing import Any

from gateway.affinity import key_hash, rank
from gateway.config import ReplicaConfig
from gateway.parsing import RequestInfo, parse
from gateway.policies import PrefixAffinity, make_policy
from gateway.replicas import Replica
from gateway.tokens import TokenCounter


def pool(*outstanding: int) -> list[Replica]:
    out = []
    for i, load in enumerate(outstanding):
        r = Replica(ReplicaConfig(url=f"http://r{i}:1"))
        r.outstanding, r.inflight = load, 1 if load else 0
        out.append(r)
    return out


def home_of(info: RequestInfo, replicas: list[Replica]) -> Replica:
    """The key's rendezvous first choice."""
    return max(replicas, key=lambda r: rank(info.prefix, key_hash(r.url.encode())))


def request(endpoint: str, **body: Any) -> RequestInfo:
    return parse(json.dumps({"model": "m", "max_tokens": 64, **body}).encode(), endpoint, TokenCounter(), 256)


def test_a_completions_head_is_a_guess_and_a_chat_key_or_prompt_cache_key_is_not() -> None:
    """Only a completions head without prompt_cache_key is marked as a guess."""
    assert request("completions", prompt="word " * 400).prefix_guessed
    assert not request("completions", prompt="word " * 400, prompt_cache_key="t1").prefix_guessed
    assert not request("chat", messages=[{"role": "user", "content": "hi"}]).prefix_guessed


def test_a_long_completions_prompt_seen_once_is_routed_by_load_and_goes_home_when_it_recurs() -> None:
    """The first time a head is seen nothing is cached anywhere: load decides. Seen again, its home takes it
    while within the bound."""
    info = request("completions", prompt="word " * 400)
    assert info.prefix_tokens > 0
    replicas = pool(0, 0)
    home = home_of(info, replicas)
    home.outstanding, home.inflight = 600, 2  # the home is busier: load alone avoids it
    policy = PrefixAffinity()
    assert policy.pick(replicas, info) is not home
    assert policy.pick(replicas, info) is home  # recurring: its head is cached at home, worth the extra load
    assert make_policy("estimated_ttft").pick(replicas, info) is not home


def test_a_chat_first_turn_goes_home_when_that_is_somewhat_busier_so_its_second_turn_finds_its_cache() -> None:
    """A first turn takes its rendezvous first choice while within its share of worth (here 200 tokens more
    outstanding than the other replica); its second turn then goes to the same replica."""
    system = {"role": "system", "content": "Be brief. " * 20}
    opening = {"role": "user", "content": "tell me about caches " * 40}
    first = request("chat", messages=[system, opening])
    second = request("chat", messages=[system, opening, {"role": "assistant", "content": "ok " * 50},
                                       {"role": "user", "content": "more"}])
    replicas = pool(0, 0)
    home = home_of(first, replicas)
    home.outstanding, home.inflight = 200, 1
    policy = PrefixAffinity()
    assert policy.pick(replicas, first) is home
    assert policy.pick(replicas, second) is home
    home.outstanding = 20_000  # far busier: the first turn goes elsewhere
    assert policy.pick(replicas, first) is not home


def test_consistent_hash_sends_every_keyed_request_to_its_first_choice_whatever_the_load() -> None:
    """The sticky baseline: the key's rendezvous first choice even when it is far busier; no key: by load."""
    info = request("chat", messages=[{"role": "user", "content": "hello " * 50}])
    replicas = pool(0, 0)
    home = home_of(info, replicas)
    home.outstanding, home.inflight = 50_000, 30
    policy = make_policy("consistent_hash")
    assert all(policy.pick(replicas, info) is home for _ in range(3))
    assert policy.pick(replicas, RequestInfo("m", 10, 10, True)) is not home


SEEDS = tuple(range(10))
# A key's replica order hashes the replica URLs: fixed ports (below Linux's ephemeral range) make a run repeatable
REPLICA_PORT = 28431
CHATS, START_GAP_S = 16, 0.05  # conversations, and their mean gap: they overlap, as the Poisson starts do


async def chats_hit_rate(policy: str, seed: int) -> tuple[float, list[list[str]]]:
    """CHATS chats starting as a Poisson process (seeded) over three fresh simulated replicas with prefix caching,
    turns sent alternately through two gateways, the second replaced by a fresh one (a restart) after the first
    chat's second turn: the replicas' prefix-cache hit rate and each chat's replicas.

    The same every run: the replicas' steps, the gateways and the clients share one virtual clock (`sim.vloop`),
    and the replicas listen on fixed ports (a key's replica order hashes their URLs). Each seed is another start
    schedule and another set of ports, so other chats share a home. Before, on OS-given ports and real time, 3 of 14
    runs on a quiet machine fell below the goal: the ports and timing drawn, not a change in the code."""
    import asyncio
    import contextlib
    import re

    import aiohttp
    import openai
    from aiohttp import web

    from gateway.app import running
    from gateway.config import from_mapping
    from sim.clock import LoopClock
    from sim.gpus import get_gpu
    from sim.model import load_model
    from sim.node import Node, NodeSpec
    from sim.server import make_app

    node = Node(NodeSpec(load_model("opt-1.3b"), get_gpu("H100-80GB"), 3, 64, prefix_caching=True),
                LoopClock(asyncio.get_running_loop()))
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for i, engine in enumerate(node.engines):
            runner = web.AppRunner(make_app(engine, "sim", seed=i))
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", REPLICA_PORT + 3 * seed + i)
            try:
                await site.start()
            except OSError:  # taken: any port (the replicas' ranks, and so the result, then differ)
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")

        async def client() -> openai.AsyncOpenAI:
            """A client of a fresh gateway, its first call made (the SDK asks the platform in a thread once: a
            thread's real time is not on the virtual clock, so it goes before the chats start)."""
            config = from_mapping({"replicas": urls, "host": "127.0.0.1", "port": 0, "policy": policy,
                                   "health": {"interval_s": 60, "timeout_s": 30}})
            gw, port = await stack.enter_async_context(running(config, grace_s=1))
            assert gw.health is not None
            await gw.health.probe_all()
            sdk = await stack.enter_async_context(openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0))
            await sdk.models.list()
            return sdk

        # the third gateway replaces the second after chat 0's second turn (a restart: it has served nothing)
        clients = [await client() for _ in range(3)]
        system = {"role": "system", "content": "You answer questions about serving. " * 6}

        async def conversation(c: int, start: float) -> list[str]:
            await asyncio.sleep(start)
            messages: list[Any] = [system, {"role": "user", "content": f"Chat {c}: " + "why cache prefixes? " * 30}]
            served = []
            for turn in range(4):
                raw = await clients[turn % 2].chat.completions.with_raw_response.create(
                    model="sim", messages=messages, max_tokens=32, extra_body={"ignore_eos": True})
                served.append(raw.headers["x-gateway-replica"])
                messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
                             {"role": "user", "content": "and then? " * 10}]
                if turn == 1 and c == 0:
                    clients[1] = clients.pop()  # restarted: no memory
            return served

        rng, start, starts = random.Random(seed), 0.0, []
        for _ in range(CHATS):
            starts.append(start)
            start += rng.expovariate(1 / START_GAP_S)
        chats = await asyncio.gather(*(conversation(c, s) for c, s in enumerate(starts)))
        hits = queries = 0.0
        async with aiohttp.ClientSession() as session:
            for url in urls:
                text = await (await session.get(f"{url}/metrics")).text()
                hits += float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M).group(1))  # type: ignore
                queries += float(re.search(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text,
                                           re.M).group(1))  # type: ignore
    return hits / queries, chats


def test_concurrent_conversations_across_gateways_and_a_restart_hit_the_cache_as_if_pinned() -> None:
    """Chats starting close together, turns alternating between two gateways, one restarted midway: the default's
    prefix-cache hit rate is within 5 points of consistent_hash's (every chat pinned to one replica), and most
    chats never move (placement depends on the request and the replicas' load, not on a gateway's memory)."""
    from sim.vloop import run

    for seed in SEEDS:
        pinned, pinned_chats = run(chats_hit_rate("consistent_hash", seed))
        default, chats = run(chats_hit_rate("prefix_affinity", seed))
        assert all(len(set(served)) == 1 for served in pinned_chats)
        assert default >= pinned - 0.05, (seed, default, pinned)  # the goal: within 5 points of sticky
        # most chats never move (the others moved off a home that was busiest when a turn arrived)
        assert sum(len(set(served)) == 1 for served in chats) >= CHATS // 2, [[u[-5:] for u in s] for s in chats]
        assert len({served[0] for served in chats}) > 1  # and the chats spread over the replicas
