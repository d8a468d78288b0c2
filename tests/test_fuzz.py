"""Fuzzing the gateway's HTTP server, replica client and request parsing (harnesses: tests/fuzz/harness.py).

Bounded for CI (about 20 s in all): hypothesis draws `SMALLSERVE_FUZZ_EXAMPLES` inputs per test (default 100)
and atheris runs each target for a few seconds of coverage-guided inputs (`SMALLSERVE_ATHERIS_SCALE` multiplies
their number). Longer runs and what they found: docs/fuzzing.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.fuzz.harness import ClientRequest, Reply, Session, gateway_bytes, parse_body, relay_answers, serve_bytes
from tests.fuzz.strategies import chunked_streams, client_requests, client_streams, http_requests, mutated, replies, request_bodies

EXAMPLES = int(os.environ.get("SMALLSERVE_FUZZ_EXAMPLES", "100"))
# runs per target: what each does in about 2 s here (the replica target runs the whole gateway per input)
ATHERIS_SCALE = float(os.environ.get("SMALLSERVE_ATHERIS_SCALE", "1"))
ATHERIS_RUNS = {"server": 1500, "gateway": 1000, "replica": 250, "parsing": 5000}
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
ROOT = Path(__file__).resolve().parent.parent


@FUZZ
@given(client_streams(), st.booleans(), st.booleans())
def test_server_takes_any_client_bytes(stream: tuple[list[bytes], list[float]], client_closes: bool,
                                       slow_reader: bool) -> None:
    """The HTTP server alone: no exception, no 5xx, well-formed complete answers, no hang, for any client bytes."""
    pieces, gaps = stream
    serve_bytes(pieces, gaps, client_closes=client_closes, slow_reader=slow_reader)


@FUZZ
@given(client_streams(), st.booleans(), st.booleans())
def test_gateway_takes_any_client_bytes(stream: tuple[list[bytes], list[float]], client_closes: bool,
                                        slow_reader: bool) -> None:
    """The whole gateway: as above, and each client request reaches a replica at most once, unchanged."""
    pieces, gaps = stream
    gateway_bytes(pieces, gaps, client_closes=client_closes, slow_reader=slow_reader)


@FUZZ
@given(st.lists(client_requests, min_size=1, max_size=4), st.lists(replies(), max_size=10), st.booleans())
def test_gateway_takes_any_replica_answer(requests: list[ClientRequest], answers: list[Reply],
                                          concurrent: bool) -> None:
    """Replicas answering anything: one clean answer per client, no retry after bytes reached it, no desync."""
    relay_answers(requests, iter(answers), concurrent=concurrent)


@FUZZ
@given(chunked_streams())
def test_stream_reaches_the_client_unchanged(stream: tuple[bytes, Reply]) -> None:
    """A well-formed stream, however its chunks fall into reads, reaches the client whole and unchanged (reads of
    one whole chunk are relayed as they came, the others parsed and framed again: gateway/upstream.py)."""
    body, reply = stream
    run = relay_answers([ClientRequest(stream=True)], iter([reply]))
    answer = run.answers[0]
    assert answer.status == 200 and answer.complete
    assert answer.body == body


@FUZZ
@given(request_bodies(), st.sampled_from(["completions", "chat", "embeddings"]))
def test_parsing_takes_any_body(body: bytes, endpoint: str) -> None:
    """Request parsing: a RequestInfo with sane numbers, or a 400; never another exception."""
    parse_body(body, endpoint)


class GatewayConnection(RuleBasedStateMachine):
    """One client connection to the whole gateway, driven a step at a time; the promises checked after each."""

    def __init__(self) -> None:
        super().__init__()
        self.session = Session(gateway=True)

    @rule(request=http_requests())
    def send_request(self, request: bytes) -> None:
        self.session.send(request)

    @rule(data=st.data())
    def send_mutated_request(self, data: st.DataObject) -> None:
        self.session.send(data.draw(mutated(data.draw(http_requests()))))

    @rule(size=st.integers(1, 40), data=st.data())
    def send_part_of_a_request(self, size: int, data: st.DataObject) -> None:
        self.session.send(data.draw(http_requests())[:size])

    @rule(seconds=st.sampled_from([0.0, 0.01, 0.5, 2.5, 6.0]))
    def wait(self, seconds: float) -> None:
        self.session.wait(seconds)

    @rule()
    def hang_up(self) -> None:
        if not self.session.client_closed:
            self.session.close_client()

    @invariant()
    def promises_hold(self) -> None:
        self.session.check()

    def teardown(self) -> None:
        self.session.finish()


TestGatewayConnection = GatewayConnection.TestCase
TestGatewayConnection.settings = settings(max_examples=max(10, EXAMPLES // 5), stateful_step_count=10, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("target", ["server", "gateway", "replica", "parsing"])
def test_atheris_run_finds_nothing(target: str, tmp_path: Path) -> None:
    """A bounded coverage-guided atheris run of each target ends without a finding."""
    pytest.importorskip("atheris", reason="atheris has wheels for Linux x86_64 only")
    result = subprocess.run([sys.executable, "-m", "tests.fuzz.atheris_main", target, f"-runs={int(ATHERIS_RUNS[target] * ATHERIS_SCALE)}",
                             "-seed=1", f"-artifact_prefix={tmp_path}/", str(tmp_path / "corpus")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done" in result.stderr, result.stderr[-3000:]
