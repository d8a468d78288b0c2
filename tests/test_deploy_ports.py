"""Ports for slow-starting servers come from below the ephemeral range; a probe that reads its own request back
is a "not ready", not a crash (the CI failure of stop 34: `BadStatusLine: GET /ready HTTP/1.1`)."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.ports import DEFAULT_EPHEMERAL_LOW, LOWEST, ephemeral_low, free_ports, port_bound
from deploy.process import probe


def test_free_ports_lie_below_the_ephemeral_range_and_are_unbound() -> None:
    low = ephemeral_low()
    for seed in range(20):
        base = free_ports(3, random.Random(seed))
        assert LOWEST <= base and base + 3 <= low
        assert not any(port_bound(base + i) for i in range(3))


class Draws(random.Random):
    """Draws the given ports in turn."""

    def __init__(self, *ports: int) -> None:
        super().__init__(0)
        self.ports = list(ports)

    def randint(self, a: int, b: int) -> int:
        port = self.ports.pop(0)
        assert a <= port <= b
        return port


def test_a_held_port_is_skipped() -> None:
    free = free_ports(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", free + 1))
        held.listen()
        assert port_bound(free + 1)
        assert free_ports(1, Draws(free + 1, free)) == free


def test_the_range_comes_from_the_kernel_or_linuxs_default(tmp_path: Path) -> None:
    given = tmp_path / "range"
    given.write_text("40000\t60999\n")
    assert ephemeral_low(given) == 40000
    assert ephemeral_low(tmp_path / "missing") == DEFAULT_EPHEMERAL_LOW
    given.write_text("nonsense")
    assert ephemeral_low(given) == DEFAULT_EPHEMERAL_LOW


def test_no_room_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no room for 5 ports"):
        free_ports(5, top=LOWEST + 3)


def test_a_socket_connecting_to_its_own_unlistened_port_reads_its_own_request() -> None:
    """Why the range matters: TCP simultaneous open joins a socket to itself when source and target port agree."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_ports()))
        s.settimeout(2.0)
        s.connect(s.getsockname())
        s.sendall(b"GET /ready HTTP/1.1\r\n\r\n")
        assert s.recv(100).startswith(b"GET /ready HTTP/1.1")


@pytest.fixture
def echo() -> Iterator[int]:
    """A server that sends back what it reads: what a probe connected to itself sees."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        with server:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(conn.recv(4096))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    server.close()
    thread.join(timeout=5)


def test_a_probe_that_reads_its_own_request_back_says_not_ready(echo: int) -> None:
    assert probe(f"http://127.0.0.1:{echo}/ready", timeout_s=2.0) is False
