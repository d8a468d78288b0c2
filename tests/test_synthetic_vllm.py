"""Synthetic models served by REAL vLLM (CPU) behind the gateway: an OPT and a GQA / large-vocabulary model.

One `deploy up --plan` for the module with two replicas of different architectures, `synthetic:opt-125m` (OPT,
50272 tokens) and `synthetic:qwen3-0.6b` (grouped-query attention, head_dim 128 != hidden / heads, a 151936-token
vocabulary, tied embeddings), each loaded by vLLM from its locally made directory with `--load-format dummy`.
The official openai client talks to the gateway, which routes each request to the replica serving its model.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from deploy.plan import Admission, GatewaySpec, Plan, ReplicaSpec, dump
from deploy.ports import free_ports
from deploy.process import ManagedProcess
from synthetic.build import ensure_synthetic_model

pytestmark = pytest.mark.vllm

STARTUP_S = 300
MODELS = {"synthetic:opt-125m": "synthetic-opt-125m", "synthetic:qwen3-0.6b": "synthetic-qwen3-0.6b"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Plan, Path]]:
    """`deploy up --plan` with one replica of each synthetic model; the gateway's URL once /ready answers."""
    directory = tmp_path_factory.mktemp("synthetic-vllm")
    base = free_ports(3)
    replicas = tuple(ReplicaSpec(name=f"r{i}", model=model, port=base + 1 + i, max_num_seqs=4, max_model_len=512,
                                 cpu_kvcache_space_gib=1.0, admission=Admission(max_requests=4))
                     for i, model in enumerate(MODELS))
    plan = Plan(model="synthetic:opt-125m", replicas=replicas, gateway=GatewaySpec(port=base, queue_size=64))
    dump(plan, directory / "plan.yaml")
    argv = [sys.executable, "-m", "deploy.cli", "up", "--plan", str(directory / "plan.yaml"), "--run-dir",
            str(directory / "run"), "--startup-timeout", str(STARTUP_S), "--host", "127.0.0.1"]
    url = f"http://127.0.0.1:{base}"
    with ManagedProcess("deploy up", argv, directory / "deploy.log", f"{url}/ready",
                        startup_timeout_s=2 * STARTUP_S + 60, stop_grace_s=90):
        yield url, plan, directory


def test_both_architectures_answer_through_the_gateway(run: tuple[str, Plan, Path]) -> None:
    """/v1/models lists both; each model's completion comes from its own replica, with the tokens asked for,
    and the prompt counted by the synthetic tokenizer vLLM loaded (one token per byte, plus OPT's BOS)."""
    url, plan, _ = run
    ports = {MODELS[r.model]: r.port for r in plan.replicas}
    prompt = "Several replicas share one GPU."
    with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        assert sorted(m.id for m in client.models.list().data) == sorted(MODELS.values())
        for served, port in ports.items():
            raw = client.completions.with_raw_response.create(model=served, prompt=prompt, max_tokens=6,
                                                              extra_body={"ignore_eos": True})
            done = raw.parse()
            assert raw.headers["x-gateway-replica"] == f"http://127.0.0.1:{port}"
            assert done.usage is not None and done.usage.completion_tokens == 6 and done.choices[0].text
            bos = 1 if served == "synthetic-opt-125m" else 0
            assert done.usage.prompt_tokens == len(prompt.encode()) + bos


def test_chat_uses_the_family_template_and_stops_at_its_eos(run: tuple[str, Plan, Path]) -> None:
    """A chat request to the Qwen3 architecture renders ChatML: 'Hi' becomes 10 tokens around the role markers."""
    url, _, _ = run
    with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        done = client.chat.completions.create(model="synthetic-qwen3-0.6b", max_tokens=4,
                                              messages=[{"role": "user", "content": "Hi"}])
    # <|im_start|> "user\nHi" <|im_end|> "\n" <|im_start|> "assistant\n": 3 specials + 7 + 1 + 10 bytes.
    assert done.usage is not None and done.usage.prompt_tokens == 3 + len("user\nHi") + 1 + len("assistant\n")
    assert done.choices[0].message.content is not None


def test_replicas_loaded_dummy_weights_from_the_local_directory(run: tuple[str, Plan, Path]) -> None:
    """Each replica was started on the synthetic directory with --load-format dummy (no weights exist)."""
    _, plan, directory = run
    for spec in plan.replicas:
        log = (directory / "run" / "logs" / f"{spec.name}.log").read_text(errors="replace")
        source = ensure_synthetic_model(spec.model.removeprefix("synthetic:"))
        assert f"--model {source} " in log and "--load-format dummy" in log
        assert not list(source.glob("*.safetensors"))
