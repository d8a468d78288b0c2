"""Ports for servers that start slowly and are probed until they answer.

A port handed out by the kernel (bind to port 0) lies in its ephemeral range, the range it also draws client
source ports from. A client that probes such a port before its server binds can be given that very port as its
own source port, and then connects to itself (TCP simultaneous open): it reads back its own request
("GET /ready HTTP/1.1" as the status line), and while it holds the port the server cannot bind. So a port for a
server that is probed while it starts comes from below that range.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default start of the ephemeral range, where the kernel does not say.
DEFAULT_EPHEMERAL_LOW = 32768
LOWEST = 10000


def ephemeral_low(path: Path = PORT_RANGE) -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def port_bound(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something holds the port so that a server binding it with SO_REUSEADDR would fail."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_ports(count: int = 1, rng: random.Random | None = None, top: int | None = None) -> int:
    """The first of `count` consecutive ports that nothing holds now, all below the ephemeral range (or `top`).

    Another process can still take one before our server does; the ports are drawn at random to make that rare.
    """
    rng = rng or random.Random()
    highest = (ephemeral_low() if top is None else top) - count
    if highest < LOWEST:
        raise RuntimeError(f"no room for {count} ports between {LOWEST} and the ephemeral range's start")
    for _ in range(200):
        base = rng.randint(LOWEST, highest)
        if not any(port_bound(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"found no {count} consecutive free ports below {highest + count} in 200 tries")
