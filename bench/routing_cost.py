"""What routing costs on the request path, per request: parsing the body (token estimate and affinity key), and
choosing and leasing a replica, for each policy. A micro-benchmark of the gateway's own functions, in-process.

Bodies: a chat turn with a 1,000-character system prompt and a four-message history (the affinity key hashes the
system prompt and the opening message), and a 2,000-character completions prompt (the key hashes its first 1,024
bytes). Pools of 2, 4 and 16 replicas with some load. Medians of `--rounds` rounds of `--requests` each.

    python -m bench.routing_cost [--requests 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable

from gateway.config import POLICY_NAMES, ReplicaConfig
from gateway.parsing import RequestInfo, parse
from gateway.policies import Policy, make_policy
from gateway.replicas import Lease, Replica
from gateway.tokens import TokenCounter

from .common import markdown_table

SYSTEM = "You are a helpful assistant who answers briefly and cites sources. " * 15
CHAT = json.dumps({"model": "m", "max_tokens": 128, "stream": True, "messages": [
    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a prefix cache keep? " * 4},
    {"role": "assistant", "content": "The KV blocks of prompts it has seen. " * 10},
    {"role": "user", "content": "And how are they evicted? " * 3}]}).encode()
COMPLETION = json.dumps({"model": "m", "max_tokens": 128, "stream": True, "prompt": "lorem ipsum dolor " * 110}).encode()


def pool(n: int, rng: random.Random) -> list[Replica]:
    replicas = []
    for i in range(n):
        r = Replica(ReplicaConfig(url=f"http://10.0.0.{i}:8000", max_num_seqs=64))
        r.healthy, r.models = True, frozenset({"m"})
        r.inflight = rng.randint(0, 70)
        r.outstanding = r.inflight * rng.randint(100, 600)
        r.prefill = rng.randint(0, 2000)
        replicas.append(r)
    return replicas


def per_call_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(n):
            fn()
        times.append((time.perf_counter_ns() - start) / n / 1000)
    return statistics.median(times)


def route(policy: Policy, replicas: list[Replica], info: RequestInfo) -> None:
    """What the router does per request: pick, lease; and the release at the end."""
    Lease(policy.pick(replicas, info), info, _nothing).release()


def _nothing() -> None:
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    counter = TokenCounter()
    rows = []
    for name, body, endpoint in (("chat, 4 messages", CHAT, "chat"), ("completions, 2 KB", COMPLETION, "completions")):
        cost = per_call_us(functools.partial(parse, body, endpoint, counter, 256), args.requests, args.rounds)
        rows.append([f"parse {name}", "", f"{cost:.2f}"])
    info = parse(CHAT, "chat", counter, 256)
    plain = RequestInfo(info.model, info.prompt_tokens, info.max_tokens, info.stream)
    for n in (2, 4, 16):
        replicas = pool(n, random.Random(n))
        cases = [(name, make_policy(name, random.Random(0)), info) for name in POLICY_NAMES]
        cases.append(("prefix_affinity, no key", make_policy("prefix_affinity"), plain))
        for name, policy, request in cases:
            cost = per_call_us(functools.partial(route, policy, replicas, request), args.requests, args.rounds)
            rows.append([f"pick + lease, {name}", str(n), f"{cost:.2f}"])
    print(markdown_table(["step", "replicas", "us per request"], rows))


if __name__ == "__main__":
    main()
