"""`sim serve`: simulated replicas speak OpenAI (official client), stream at the simulated pace, export vLLM
metrics, and work behind the real gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from deploy.ports import free_ports
from sim.clock import LoopClock
from sim.gpus import get_gpu
from sim.model import load_model
from sim.measured import FrontEnd, MeasuredStepTime, ReplicaModel
from sim.node import MeasuredSpec, Node, NodeSpec
from sim.server import make_app
from tests.conftest import GatewayFactory

NAME = "facebook/opt-125m"
SimFactory = Callable[..., Awaitable[tuple[Node, list[str]]]]


@pytest.fixture
def sim_replicas(aiohttp_server: Any) -> SimFactory:
    """Start N simulated replicas sharing one simulated GPU on the test's loop; returns the node and URLs."""
    async def start(replicas: int = 1, model: str = "opt-125m", **spec: Any) -> tuple[Node, list[str]]:
        node = Node(NodeSpec(load_model(model), get_gpu(spec.pop("gpu", "H100-80GB")), replicas, **spec),
                    LoopClock(asyncio.get_running_loop()))
        urls = []
        for i, engine in enumerate(node.engines):
            # aiohttp's TestServer cancels handlers when the client goes away, as `sim serve` does.
            server: TestServer = await aiohttp_server(make_app(engine, load_model(model).name, seed=i))
            urls.append(str(server.make_url("")).rstrip("/"))
        return node, urls
    return start


async def test_openai_client_completions_and_chat(sim_replicas: SimFactory) -> None:
    """Completions and chat, streaming or not, through the official client; ignore_eos gives max_tokens tokens."""
    _, (url,) = await sim_replicas()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none") as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == [NAME]
        done = await client.completions.create(model=NAME, prompt="hello world", max_tokens=7,
                                               extra_body={"ignore_eos": True})
        assert done.choices[0].text == " tok" * 7 and done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 7 and done.usage.prompt_tokens == 3
        stream = await client.completions.create(model=NAME, prompt=[1, 2, 3, 4, 5], max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert texts == [" tok"] * 12 and chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.completion_tokens == 12
        chat = await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, stream=True, extra_body={"ignore_eos": True})
        pieces = [c.choices[0].delta.content async for c in chat if c.choices and c.choices[0].delta.content]
        assert pieces == [" tok"] * 4


async def test_without_ignore_eos_requests_may_stop_early(sim_replicas: SimFactory) -> None:
    """Without ignore_eos a simulated EOS ends some requests before max_tokens, with finish_reason stop."""
    _, (url,) = await sim_replicas()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none") as client:
        results = await asyncio.gather(*(client.completions.create(model=NAME, prompt="x", max_tokens=400)
                                         for _ in range(20)))
    reasons = {r.choices[0].finish_reason for r in results}
    assert "stop" in reasons
    assert all(len(r.choices[0].text) == 4 * r.usage.completion_tokens for r in results if r.usage)


async def test_errors_are_openai_shaped(sim_replicas: SimFactory) -> None:
    """An unknown model is a 404, a too-long request a 400 naming the context length."""
    _, (url,) = await sim_replicas()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.completions.create(model="other", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
            await client.completions.create(model=NAME, prompt="x" * 4000, max_tokens=2000)


async def test_tokens_stream_at_the_simulated_pace(sim_replicas: SimFactory) -> None:
    """A lone 40-token request takes about 40 simulated steps of real time: not instant, not much slower."""
    node, (url,) = await sim_replicas(model="opt-2.7b", gpu="L4", utilization=0.9)
    step = node.steptime.host_s(1) + node.steptime.device_s(1, 1, 200, 200)
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        async with session.post(url + "/v1/completions", json={"model": "facebook/opt-2.7b", "prompt": "x" * 400,
                                                                "max_tokens": 40, "ignore_eos": True,
                                                                "stream": True}) as resp:
            arrivals = [time.perf_counter() async for line in resp.content if line.startswith(b"data: {")]
    elapsed = time.perf_counter() - start
    assert len(arrivals) == 40
    assert 0.9 * 40 * step < elapsed < 3 * 40 * step + 0.5
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(step, rel=0.5)


async def test_metrics_use_vllm_names_and_count(sim_replicas: SimFactory) -> None:
    """/metrics parses as Prometheus text with vLLM's names; running, waiting, KV usage and blocks are reported;
    clients that go away get their requests aborted."""
    node, (url,) = await sim_replicas(max_num_seqs=4)
    async with aiohttp.ClientSession() as session:
        body = {"model": NAME, "prompt": "y" * 200, "max_tokens": 1500, "ignore_eos": True}
        tasks = [asyncio.create_task(session.post(url + "/v1/completions", json=body)) for _ in range(6)]
        deadline = time.monotonic() + 10
        while node.engines[0].num_running + node.engines[0].num_waiting < 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    engine = node.engines[0]
    deadline = time.monotonic() + 5
    while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.num_running == engine.num_waiting == engine.used_blocks == 0  # the clients left: aborted
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["vllm:num_requests_running"].value == 4
    assert samples["vllm:num_requests_waiting"].value == 2
    assert 0 < samples["vllm:kv_cache_usage_perc"].value < 1
    assert samples["vllm:num_preemptions_total"].value == 0
    info = samples["vllm:cache_config_info"].labels
    assert int(info["num_gpu_blocks"]) == node.engine_config.num_gpu_blocks and info["block_size"] == "16"


async def test_replicas_share_one_gpu(sim_replicas: SimFactory) -> None:
    """Two replicas of one node report their device work on the same simulated GPU."""
    node, urls = await sim_replicas(replicas=2)
    assert node.engines[0].device is node.engines[1].device
    async with aiohttp.ClientSession() as session:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
        for url in urls:
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
    assert node.device.busy_s > 0 and node.engines[0].finished_total == node.engines[1].finished_total == 1
    async with aiohttp.ClientSession() as session, session.get(urls[0] + "/metrics") as resp:
        samples = {s.name: s.value for f in text_string_to_metric_families(await resp.text()) for s in f.samples}
    # vLLM's tokens-per-step histogram: 1 prompt token ("hi") and 4 decodes after the first token, in 5 steps
    assert samples["vllm:iteration_tokens_total_count"] == node.engines[0].steps_total == 5
    assert samples["vllm:iteration_tokens_total_sum"] == 5


async def test_time_to_first_token_is_split_as_vllm_splits_it(sim_replicas: SimFactory) -> None:
    """vLLM's time_to_first_token, request_queue_time and request_prefill_time histograms (sum and count): three
    requests at once on a replica that runs one at a time, so two of them queue; each TTFT is its queue plus its
    prefill (no front end here)."""
    node, (url,) = await sim_replicas(max_num_seqs=1)
    async with aiohttp.ClientSession() as session:
        async def one() -> None:
            body = {"model": NAME, "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        await asyncio.gather(one(), one(), one())
        async with session.get(url + "/metrics") as resp:
            samples = {s.name: s.value for f in text_string_to_metric_families(await resp.text()) for s in f.samples}
    names = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")
    assert [samples[f"{n}_count"] for n in names] == [3, 3, 3]
    ttft, queue, prefill = (samples[f"{n}_sum"] for n in names)
    assert prefill > 0 and queue > prefill  # the second waited one request, the third two: 3 whole requests
    assert ttft == pytest.approx(queue + prefill, abs=1e-3)


async def test_through_the_gateway(sim_replicas: SimFactory, gateway_for: GatewayFactory) -> None:
    """The real gateway routes streaming requests over simulated replicas, using both."""
    _, urls = await sim_replicas(replicas=2)
    gw = await gateway_for(urls)
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="none") as client:
        async def one() -> tuple[str, int]:
            raw = await client.completions.with_raw_response.create(
                model=NAME, prompt="hello", max_tokens=20, stream=True, extra_body={"ignore_eos": True})
            texts = [c.choices[0].text async for c in raw.parse() if c.choices]
            return raw.headers["x-gateway-replica"], len(texts)
        results = await asyncio.gather(*(one() for _ in range(8)))
    assert {count for _, count in results} == {20}
    assert {replica for replica, _ in results} == set(urls)


async def test_sim_serve_command_serves_n_replicas_on_consecutive_ports() -> None:
    """`sim serve --replicas 2 --port P` answers on P and P+1 and stops on SIGTERM."""
    port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli", "serve", "--model", "opt-125m", "--gpu", "A100-40GB",
                             "--replicas", "2", "--port", str(port), "--max-num-seqs", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for p in (port, port + 1):
                deadline = time.monotonic() + 20
                while True:
                    assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                    try:
                        async with session.get(f"http://127.0.0.1:{p}/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    assert time.monotonic() < deadline, "sim serve did not become healthy"
                    await asyncio.sleep(0.1)
                async with session.get(f"http://127.0.0.1:{p}/metrics") as resp:
                    assert 'max_num_seqs="64"' in await resp.text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        if proc.stdout:
            proc.stdout.close()


def test_bad_flags_are_named_without_a_traceback() -> None:
    """A GPU too small for the model, or an unknown GPU, exits 2 with the reason on stderr."""
    for args, message in ((["--model", "opt-2.7b", "--gpu", "L4", "--gpu-memory-utilization", "0.1"],
                           "leave no room for a KV cache"), (["--model", "opt-125m", "--gpu", "V100"], "unknown GPU")):
        proc = subprocess.run([sys.executable, "-m", "sim.cli", "serve", *args], capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


async def test_a_measured_replica_runs_at_the_speed_it_is_set_to(aiohttp_server: Any,
                                                                 sim_replicas: SimFactory) -> None:
    """`POST /sim/speed {"scale": 3}` (what `bench.sim_vs_real --follow-speed` sends when the real engines ran three
    times slower than at the calibration): a lone 30-step request takes three times as long on the wall clock, on
    that replica only. A bad scale is a 400 in OpenAI's error shape; a replica with no replica model (the roofline)
    cannot be scaled."""
    model = ReplicaModel(model_name="m", step_s=((1, 0.01), (4, 0.012)), prefill_s_per_token=0.0, frontend_s=0.002,
                         max_num_seqs=4, max_num_batched_tokens=512, chunked_prefill=True, prefix_caching=False,
                         block_size=16, num_blocks=100, max_model_len=512)
    node = Node(MeasuredSpec(model, 2), LoopClock(asyncio.get_running_loop()))
    urls = []
    for i, engine in enumerate(node.engines):
        app = make_app(engine, "m", seed=i, frontend=FrontEnd.of_model(engine, model))
        server: TestServer = await aiohttp_server(app)
        urls.append(str(server.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as session:
        async def timed(url: str) -> float:
            body = {"model": "m", "prompt": [1, 2], "max_tokens": 30, "ignore_eos": True}
            start = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
            return time.perf_counter() - start

        base = await timed(urls[0])
        async with session.post(urls[0] + "/sim/speed", json={"scale": 3}) as resp:
            assert resp.status == 200 and await resp.json() == {"scale": 3.0}
        slow, other = await timed(urls[0]), await timed(urls[1])
        for bad in ({"scale": 0}, {"scale": "2"}, {"scale": True}, {"scale": 101}, [3], {}):
            async with session.post(urls[0] + "/sim/speed", json=bad) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "scale" and "0.01 to 100" in error["message"], bad
        async with session.post(urls[0] + "/sim/speed", data=b"{") as resp:
            assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]
        _, (roofline,) = await sim_replicas()
        async with session.post(roofline + "/sim/speed", json={"scale": 2}) as resp:
            assert resp.status == 400 and "replica model" in (await resp.json())["error"]["message"]
    scaled, unscaled = (engine.steptime for engine in node.engines)
    assert isinstance(scaled, MeasuredStepTime) and isinstance(unscaled, MeasuredStepTime)
    assert scaled.scale == 3.0 and unscaled.scale == 1.0
    assert 2.2 * base < slow < 4 * base and other < 1.6 * base, (base, slow, other)


async def test_a_reply_sent_back_in_a_chat_counts_the_tokens_it_was(aiohttp_server: Any) -> None:
    """With the served model's tokenizer (the tiny OPT one), a generated token reads as a word that tokenizer encodes
    as one token however often it repeats, so a chat history that carries a reply back is not counted longer than
    the real replica would count it (" tok" was two tokens each: 'Ġto', 'k'). Without a tokenizer, " tok"."""
    from deploy.tinymodel import ensure_tiny_model
    from sim.server import HFCoder, token_text

    coder = HFCoder(str(ensure_tiny_model()))
    word = token_text(coder)
    assert len(coder.ids(word * 64)) == 64 and len(coder.ids(" tok" * 64)) == 128
    assert token_text(None) == " tok"
    node = Node(NodeSpec(load_model("opt-125m"), get_gpu("H100-80GB"), 1), LoopClock(asyncio.get_running_loop()))
    server: TestServer = await aiohttp_server(make_app(node.engines[0], NAME, seed=0, coder=coder))
    async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="none") as client:
        reply = await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=16, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == word * 16 and len(coder.ids(word * 16)) == 16
