"""prefix_affinity's placement rules: a completions head counts once it recurs; a chat's first turn goes where its
later turns will look for its cache."""

from __future__ import annotations

import json
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
