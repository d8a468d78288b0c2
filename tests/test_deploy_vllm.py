"""End to end with REAL vLLM: `deploy up` with two CPU replicas of the tiny model behind the gateway.

One `deploy up` for the whole module (starting vLLM is the slow part); the tests run in file order and the
last one stops the deployment with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from bench.otlp_collector import Collector, otlp_collector
from deploy.ports import free_ports, port_bound

pytestmark = pytest.mark.vllm

MODEL = "tiny-opt"
STARTUP_S = 420.0


@dataclass
class Deployment:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    log: Path
    url: str

    def state(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "state.json").read_text())  # type: ignore[no-any-return]

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)


def log_tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def wait_for(predicate: Any, timeout_s: float, what: str, deployment: Deployment | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if deployment is not None and deployment.proc.poll() is not None:
            pytest.fail(f"deploy up exited ({deployment.proc.returncode}) waiting for {what}:\n"
                        f"{log_tail(deployment.log)}")
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}" +
                (f":\n{log_tail(deployment.log)}" if deployment else ""))


def all_healthy(deployment: Deployment) -> bool:
    try:
        state = deployment.state()
    except (OSError, json.JSONDecodeError):
        return False
    procs = [state["gateway"], *state["replicas"]] if state.get("gateway") else []
    return bool(procs) and all(p["healthy"] and p["status"] == "running" for p in procs)


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes in a process group (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def running_requests(replica_url: str) -> float:
    text = urllib.request.urlopen(f"{replica_url}/metrics", timeout=5).read().decode()
    values = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    assert values, "vllm:num_requests_running is missing from /metrics"
    return sum(float(v) for v in values)


def deployed(argv: list[str], run_dir: Path, port: int, env: dict[str, str] | None = None,
             startup_s: float = STARTUP_S) -> Iterator[Deployment]:
    """Run `deploy up` (argv) until its replicas and gateway on `port` are healthy, yield it, and tear it down
    in any case: SIGTERM, then SIGKILL to whatever of its process groups is left (nothing may outlive a module)."""
    log = run_dir / "deploy-up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=Path(__file__).resolve().parent.parent, env=env)
    dep = Deployment(proc, run_dir, log, f"http://127.0.0.1:{port}")
    try:
        wait_for(lambda: all_healthy(dep), startup_s, "two healthy replicas and the gateway", dep)
        yield dep
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:
            pgids = [p["pid"] for p in [dep.state()["gateway"], *dep.state()["replicas"]] if p and p["pid"]]
        except (OSError, json.JSONDecodeError, TypeError):
            pgids = []
        for pgid in pgids:
            for pid in group_members(pgid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    """A FAKE OTLP collector the module's replicas export their spans to (vLLM's --otlp-traces-endpoint)."""
    with otlp_collector() as running_collector:
        yield running_collector


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> Iterator[Deployment]:
    """`deploy up --model tiny --replicas 2` in its own session, healthy; torn down at the end in any case.

    The replicas trace to `collector` (vLLM records one span per finished request: cheap next to the request)."""
    run_dir = tmp_path_factory.mktemp("deploy-run")
    base = free_ports(3)
    argv = [sys.executable, "-m", "deploy.cli", "up", "--model", "tiny", "--replicas", "2", "--port", str(base),
            "--replica-port-base", str(base + 1), "--run-dir", str(run_dir), "--startup-timeout", "300",
            "--host", "127.0.0.1", "--silent-start-timeout", "60",  # a start logs its first line within ~10 s
            "--", "--otlp-traces-endpoint", collector.url]
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm"}
    yield from deployed(argv, run_dir, base, env)


def test_completions_and_chat_streaming_and_not(deployment: Deployment) -> None:
    """Completions and chat, streamed and not, through the gateway with the official openai client."""
    with deployment.client() as client:
        done = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8,
                                         extra_body={"ignore_eos": True})
        assert done.usage is not None and done.usage.completion_tokens == 8 and done.choices[0].text
        # vLLM's server may put several tokens in one SSE event, so count tokens from the usage event, not events.
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 8
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text
        assert [m.id for m in client.models.list()] == [MODEL]


def test_vllms_own_api_through_the_gateway(deployment: Deployment) -> None:
    """vLLM's /tokenize, /detokenize and /version answer through the gateway as the replicas do, and OpenAI's
    /v1/models/{id} too; vLLM's runtime adapter API is refused (403, OpenAI-style) and never reaches a replica."""
    with httpx.Client(base_url=deployment.url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
        with deployment.client() as client:
            done = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1)
            assert client.models.retrieve(MODEL).id == MODEL  # answered by the gateway: vLLM has no such path
        assert done.usage is not None and tokens["count"] == done.usage.prompt_tokens == len(tokens["tokens"])
        text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
        assert "Hello there" in text
        assert http.get("/version").json()["version"]
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"})
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"


def test_both_replicas_serve(deployment: Deployment) -> None:
    """Concurrent requests are spread over both replicas (the gateway names the one that answered)."""
    replicas = {r["url"] for r in deployment.state()["replicas"]}
    with deployment.client() as client:
        def one(i: int) -> str:
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"count {i}", max_tokens=32,
                                                              extra_body={"ignore_eos": True})
            raw.parse()
            return raw.headers["x-gateway-replica"]
        with ThreadPoolExecutor(8) as pool:
            served = set(pool.map(one, range(16)))
    assert served == replicas


def test_each_replica_runs_on_its_own_cores_only(deployment: Deployment) -> None:
    """On CPU every process of a replica (API server, engine, worker) is confined to that replica's cores, which
    no other replica shares (so none of them is ever moved onto a core another replica's pinned worker holds)."""
    import psutil

    masks = []
    for replica in deployment.state()["replicas"]:
        leader = psutil.Process(replica["pid"])
        processes = [leader, *leader.children(recursive=True)]
        assert len(processes) >= 3  # API server, engine core, worker
        cores = {tuple(sorted(os.sched_getaffinity(p.pid))) for p in processes}
        assert len(cores) == 1, cores
        masks.append(set(cores.pop()))
    assert len(masks) == 2 and not masks[0] & masks[1]


def prefix_cache_hits(replica_url: str) -> float:
    """vLLM's `vllm:prefix_cache_hits_total` (tokens found in the prefix cache), summed over engines."""
    text = urllib.request.urlopen(f"{replica_url}/metrics", timeout=5).read().decode()
    values = re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    assert values, "vllm:prefix_cache_hits_total is missing from /metrics"
    return sum(float(v) for v in values)


def test_a_conversation_stays_where_its_prefix_is_cached(deployment: Deployment) -> None:
    """Two four-turn chats through the default policy (prefix_affinity): each turn after the first lands on the
    replica of the turns before it, and that replica's vllm:prefix_cache_hits rises by at least a 128-token block
    (vLLM's CPU block) per later turn; the other replica's does not move."""
    replicas = [r["url"] for r in deployment.state()["replicas"]]
    system = {"role": "system", "content": "You answer questions about caches, briefly and politely. " * 12}
    with deployment.client() as client:
        for chat in range(2):
            messages: list[Any] = [system, {"role": "user", "content": f"Chat {chat}: what is a prefix cache?"}]
            before = {url: prefix_cache_hits(url) for url in replicas}
            served = []
            for turn in range(4):
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=16, extra_body={"ignore_eos": True})
                served.append(raw.headers["x-gateway-replica"])
                messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
                             {"role": "user", "content": f"And what happens at turn {turn + 2}?"}]
            after = {url: prefix_cache_hits(url) for url in replicas}
            home = served[0]
            assert served == [home] * 4
            assert after[home] - before[home] >= 3 * 128
            assert all(after[url] == before[url] for url in replicas if url != home)


def test_client_disconnect_mid_stream_aborts_the_request(deployment: Deployment) -> None:
    """A client that hangs up mid-stream: vLLM's running-request gauge is back to 0 within two seconds."""
    with deployment.client() as client:
        with client.completions.with_streaming_response.create(
                model=MODEL, prompt="Tell me everything", max_tokens=1500, stream=True,
                extra_body={"ignore_eos": True}) as response:
            replica = response.headers["x-gateway-replica"]
            lines = response.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line]
            assert got and got[0].startswith("data: ")
            assert running_requests(replica) >= 1  # 1500 tokens: seconds more of work were left
        hung_up = time.monotonic()
    wait_for(lambda: running_requests(replica) == 0, 2.0, "vllm:num_requests_running to return to 0")
    assert time.monotonic() - hung_up < 2.5


async def test_one_trace_runs_from_the_client_through_the_gateway_into_vllm(deployment: Deployment,
                                                                           collector: Collector) -> None:
    """A gateway tracing to the collector in front of these replicas (which trace there too): the client's trace id
    is on the gateway's spans and on vLLM's `llm_request`, whose parent is the gateway's upstream attempt."""
    from gateway.app import running
    from gateway.config import from_mapping

    trace_id, parent = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    replicas = [r["url"] for r in deployment.state()["replicas"]]
    config = from_mapping({"replicas": replicas, "host": "127.0.0.1", "port": 0,
                           "tracing": {"endpoint": collector.url, "timeout_s": 5}})
    async with running(config, grace_s=5) as (gateway, port):
        assert gateway.health is not None
        await gateway.health.probe_all()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
        done = await asyncio.to_thread(lambda: client.completions.create(
            model=MODEL, prompt="Tracing", max_tokens=4, extra_headers=headers))
        assert done.choices[0].text is not None
    vllm = collector.wait_for(lambda s: s.trace_id == trace_id and s.name == "llm_request", timeout_s=30)
    spans = {s.name: s for s in collector.spans if s.trace_id == trace_id}
    assert vllm, f"no llm_request span from vLLM in trace {trace_id}: {sorted(spans)}"
    assert spans["gateway.request"].parent_span_id == parent
    assert vllm[0].parent_span_id == spans["gateway.upstream"].span_id
    assert vllm[0].service == "vllm" and spans["gateway.request"].service == "smallserve-gateway"
    assert vllm[0].attributes["gen_ai.usage.completion_tokens"] == 4


def test_the_simulator_against_these_replicas_quick(deployment: Deployment, tmp_path: Path) -> None:
    """`python -m bench.sim_vs_real --quick` over this deployment's replicas: profile one, calibrate, the same
    schedule through a gateway per policy on both sides; every request completes and the simulator's median TTFT,
    TPOT and E2E are within a factor of three of the real ones (the goal's 15% is the full run's to judge). The
    default calibration (both replicas profiled at once, the side `sim-together`). Left to the fast tests
    (tests/test_bench_sim_vs_real.py, test_sim_serve.py, test_sim_fromprofile.py), for CI's time: the `isolated`
    calibration (60 s here), `--follow-speed` and `--calibration-rounds` (70 s; two experiments docs/sim.md found
    fragile), `--repeats` (about 20 s a repeat)."""
    import math

    from sim.measured import ReplicaModel

    out = tmp_path / "svr"
    done = subprocess.run([sys.executable, "-m", "bench.sim_vs_real", "--quick", "--out", str(out), "--port", "18500",
                           "--deployment", str(deployment.run_dir)],
                          capture_output=True, text=True, timeout=840,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    sides = ("real", "sim-together")
    assert {(r["side"], r["policy"]) for r in rows} == {(s, p) for s in sides
                                                        for p in ("prefix_affinity", "round_robin")}
    together = ReplicaModel.load(out / "replica_together.json")  # fitted to the first of two profiles taken at once
    assert together.block_size == 128 and together.max_num_seqs == 32 and together.prefix_caching
    assert sorted(p.name for p in (out / "profile-quick_together" / "1").glob("point-b*.json")) == [
        "point-b00001.json", "point-b00008.json"]  # the second replica, profiled at the same time
    assert all(r["failed"] == 0 and r["completed"] > 10 for r in rows), \
        [(r["side"], r["policy"], r["completed"], r["failed"]) for r in rows]
    # where the CPU went: two cores, each replica's process tree using part of one
    assert all(len(r["cpu"]["cores_busy"]) == os.cpu_count() and 0 < sum(r["cpu"]["replicas"]) for r in rows), \
        [(r["side"], r["policy"], r["cpu"]) for r in rows]
    assert "Where the CPU went" in (out / "report.md").read_text()
    # each first token with what it came from (bench.sim_ranking's tail): its TTFT as in ttft_s, the prompt's
    # length (mix: 128 or 1,024 tokens), the replica the gateway named (real) or sim serve's URL
    for r in rows:
        assert [f[1] for f in r["firsts"]] == pytest.approx(r["ttft_s"], abs=1e-5)
        assert {f[2] for f in r["firsts"]} <= {128, 1024} and all(f[3] for f in r["firsts"]), r["firsts"][:3]
    # the engines' own steps, from vLLM's counters and sim serve's: every step computes a token or more, and a
    # replica's mean step over the run's span lies between 1 ms and 1 s
    assert all(0 < r["engine"]["steps"] <= r["engine"]["tokens"] and r["engine"]["generated"] > 0
               and 0.001 < r["engine"]["span_s"] * 2 / r["engine"]["steps"] < 1 for r in rows), \
        [(r["side"], r["policy"], r["engine"]) for r in rows]
    assert "The engines' own steps (`sim-together`)" in (out / "report.md").read_text()
    # where TTFT goes, from vLLM's own request timings and sim serve's: queue and prefill within the API server's
    # TTFT, and that within the client's (through the gateway)
    for r in rows:
        parts = r["engine"]["ttft_parts"]
        assert 0 <= parts["queue_s"] and 0 < parts["prefill_s"], (r["side"], parts)
        assert parts["queue_s"] + parts["prefill_s"] <= parts["engine_ttft_s"] * 1.001 + 1e-4, (r["side"], parts)
        assert parts["engine_ttft_s"] < sum(r["ttft_s"]) / len(r["ttft_s"]), (r["side"], parts)
    assert "## Where time to first token goes" in (out / "report.md").read_text()
    by = {(r["side"], r["policy"]): r for r in rows}
    # A factor of three: this catches a simulator that is not calibrated or off by its units,
    # and the full run judges the goal's 15%. Tighter is inside this machine's noise for one 6-s run: identical
    # real runs differ by up to 1.8 x, slow phases of the machine slow the engines by 40-60% (docs/sim.md), and the
    # simulator is optimistic on top (TPOT at 0.496 x real for the isolated calibration in one full-suite run of
    # five, 0.485 x for the together one in another).
    for policy in ("prefix_affinity", "round_robin"):
        for metric in ("ttft_s", "tpot_s", "e2e_s"):
            real, sim = (sorted(by[(s, policy)][metric]) for s in ("real", "sim-together"))
            a, b = real[len(real) // 2], sim[len(sim) // 2]
            assert math.isfinite(b) and 1 / 3 < b / a < 3, (policy, metric, a, b)
    report = (out / "report.md").read_text()
    assert "mix/poisson/0.5" in report and "Real against `sim-together`" in report
    # the verdict first: the side against the goals, and the engines' speed against the calibration from the
    # counters of the two real runs
    goals = report.split("## The goals")[1].split("\n## ")[0]
    assert report.index("## The goals") < report.index("Real against `sim-together`")
    assert "| `sim-together` (calibrated with every replica busy) | 2 |" in goals
    assert "over the 2 single-turn real runs the engines stepped" in goals


def test_killed_replica_is_routed_around_restarted_and_taken_back(deployment: Deployment) -> None:
    """SIGKILL one replica's group: every later request succeeds; it is restarted and the gateway uses it again."""
    victim = deployment.state()["replicas"][0]
    os.killpg(victim["pid"], signal.SIGKILL)
    with deployment.client() as client:
        for i in range(10):
            done = client.completions.create(model=MODEL, prompt=f"after the kill {i}", max_tokens=4)
            assert done.choices[0].text is not None
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                                max_tokens=4, stream=True)
        assert [c for c in stream]

        def restarted() -> bool:
            r0 = deployment.state()["replicas"][0]
            return bool(r0["restarts"] >= 1 and r0["healthy"] and r0["status"] == "running")
        wait_for(restarted, 300, "the killed replica to be restarted and healthy", deployment)
        assert deployment.state()["replicas"][0]["pid"] != victim["pid"]

        def taken_back() -> bool:
            ready = json.loads(urllib.request.urlopen(f"{deployment.url}/ready", timeout=5).read())
            return victim["url"] in ready["healthy_replicas"]
        wait_for(taken_back, 30, "the gateway to take the replica back", deployment)

        def one(i: int) -> str:
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"back {i}", max_tokens=32,
                                                              extra_body={"ignore_eos": True})
            raw.parse()
            return raw.headers["x-gateway-replica"]
        with ThreadPoolExecutor(8) as pool:
            assert victim["url"] in set(pool.map(one, range(16)))


def test_rolling_restart_under_load_fails_no_request(deployment: Deployment) -> None:
    """`deploy restart --rolling --replica <the second>` while two clients keep sending (one streaming): it is
    drained in the gateway, restarted and taken back, and not one request fails; the first replica is untouched.
    One replica, for CI's time (a vLLM start is 45-50 s here): tests/test_deploy_rolling.py restarts every one
    of a deployment, over fake replicas."""
    before = deployment.state()
    stop = threading.Event()
    done: list[str] = []
    failures: list[str] = []

    def client(i: int) -> None:
        with deployment.client() as openai_client:
            while not stop.wait(0.2):  # a steady load that leaves the restarting replica a core to start on
                try:
                    if i % 2:
                        chunks = list(openai_client.completions.create(
                            model=MODEL, prompt=f"rolling {i}", max_tokens=8, stream=True,
                            extra_body={"ignore_eos": True}))
                        assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
                    else:
                        answer = openai_client.completions.create(model=MODEL, prompt=f"rolling {i}", max_tokens=8,
                                                                  extra_body={"ignore_eos": True})
                        assert answer.usage is not None and answer.usage.completion_tokens == 8
                    done.append("ok")
                except Exception as exc:  # any failure at all is what this test counts
                    failures.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        result = subprocess.run([sys.executable, "-m", "deploy.cli", "restart", "--rolling", "--run-dir",
                                 str(deployment.run_dir), "--startup-timeout", "300", "--replica",
                                 before["replicas"][1]["name"]],
                                capture_output=True, text=True, timeout=900,
                                cwd=Path(__file__).resolve().parent.parent)
        served = len(done)
        wait_for(lambda: len(done) > served + 8, 60, "requests after the restart", deployment)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert result.returncode == 0, result.stderr[-3000:]
    after = deployment.state()
    assert failures == [] and len(done) > 20
    (kept, same), (old, new) = zip(before["replicas"], after["replicas"])
    assert new["pid"] != old["pid"] and new["restarts"] == old["restarts"] + 1 and new["healthy"]
    assert same["pid"] == kept["pid"] and same["restarts"] == kept["restarts"] and same["healthy"]
    assert f"deploy: {old['name']} restarted" in result.stderr
    assert after["gateway"]["pid"] == before["gateway"]["pid"]


def test_sigterm_stops_every_process_and_frees_the_ports(deployment: Deployment) -> None:
    """SIGTERM to `deploy up`: it exits 0, no vLLM or gateway process is left, every port is free again."""
    state = deployment.state()
    procs = [state["gateway"], *state["replicas"]]
    pgids = [p["pid"] for p in procs]
    members = {pid for pgid in pgids for pid in group_members(pgid)}
    assert len(members) >= 2 * len(state["replicas"]) + 1  # vLLM runs an API server and an engine core per replica
    deployment.proc.send_signal(signal.SIGTERM)
    assert deployment.proc.wait(90) == 0, log_tail(deployment.log)
    assert [pgid for pgid in pgids if group_members(pgid)] == []
    alive = [pid for pid in members if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"]
    assert alive == []
    ports = [int(p["url"].rsplit(":", 1)[1]) for p in procs]
    assert all(not port_bound(port) for port in ports)
    final = deployment.state()
    assert final["stopped"] is True and not any(r["healthy"] for r in final["replicas"])
