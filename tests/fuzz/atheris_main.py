"""Coverage-guided fuzzing of the gateway with atheris (libFuzzer): `python -m tests.fuzz.atheris_main TARGET [ARGS]`.

TARGET: server (client bytes into the HTTP server), gateway (client bytes into the whole gateway), replica (replica
answers into the whole gateway), parsing (request bodies). ARGS go to libFuzzer, e.g. `-runs=100000`,
`-max_total_time=600`, `-jobs=2`, a corpus directory (created and seeded when missing; default: a temporary one).
The gateway's own modules are instrumented for coverage; a broken promise (`harness.Broken`) or any other
exception is a finding, written by libFuzzer as `crash-<sha1>` for `python -m tests.fuzz.atheris_main TARGET FILE`
to replay. See docs/fuzzing.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["gateway"]):
    from tests.fuzz import harness

GAPS = (0.0, 0.0, 0.0, 0.001, 0.05, 1.0, 2.5, 6.0)
ENDINGS = ("keep", "close", "reset", "silent", "extra")
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/other")
ENDPOINTS = ("completions", "chat", "embeddings")


class Reader:
    """Reads an input from its front: a few control bytes, then the payload (atheris's FuzzedDataProvider takes
    integers from the back and booleans from the front, which makes seeds hard to write)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def pick(self, n: int) -> int:
        """0..n-1 from the next byte (0 once the input is used up)."""
        byte = self._data[self._pos] if self._pos < len(self._data) else 0
        self._pos += 1
        return byte % n

    def bytes(self, n: int) -> bytes:
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def rest(self) -> bytes:
        return self.bytes(len(self._data))


def _split(reader: Reader, data: bytes) -> tuple[list[bytes], list[float]]:
    """`data` cut where the next bytes say (one byte: how many cuts; two per cut: where; one per piece: the pause)."""
    cuts = sorted({1 + (reader.pick(256) << 8 | reader.pick(256)) % max(1, len(data)) for _ in range(reader.pick(8))})
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]) if b > a]
    return pieces, [GAPS[reader.pick(len(GAPS))] for _ in pieces]


def client_bytes(gateway: bool) -> Callable[[bytes], None]:
    """flags (bit 0: the client hangs up at the end, bit 1: it reads slowly), cut count, cuts, pauses; then bytes."""
    def one_input(data: bytes) -> None:
        reader = Reader(data)
        flags, cuts = reader.pick(4), reader.bytes(1 + 2 * 7)
        stream = reader.rest()
        pieces, gaps = _split(Reader(cuts + bytes(8)), stream)
        harness.serve_bytes(pieces, gaps, client_closes=bool(flags & 1), slow_reader=bool(flags & 2), gateway=gateway)
    return one_input


def replica_answers(data: bytes) -> None:
    """concurrent?, request count, per request (path, stream); then per answer: ending, length (2 bytes), cut count,
    cuts, pauses, the answer's bytes."""
    reader = Reader(data)
    concurrent = bool(reader.pick(2))
    requests = [harness.ClientRequest(PATHS[reader.pick(3)], bool(reader.pick(2))) for _ in range(1 + reader.pick(3))]
    replies = []
    while len(replies) < 6:
        head = reader.bytes(1)
        if not head:
            break
        ending = ENDINGS[head[0] % len(ENDINGS)]
        length = reader.pick(256) << 8 | reader.pick(256)
        control = reader.bytes(1 + 2 * 4)
        answer = reader.bytes(length % 2048)
        pieces, gaps = _split(Reader(control + bytes(5)), answer)
        replies.append(harness.Reply(tuple(pieces), tuple(gaps), ending))
    harness.relay_answers(requests, iter(replies), concurrent=concurrent)


def parsing(data: bytes) -> None:
    """endpoint; then the body."""
    reader = Reader(data)
    endpoint = ENDPOINTS[reader.pick(3)]
    harness.parse_body(reader.rest(), endpoint)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "server": client_bytes(gateway=False), "gateway": client_bytes(gateway=True),
    "replica": replica_answers, "parsing": parsing,
}


def _body(**fields: object) -> bytes:
    return json.dumps({"model": harness.MODEL, **fields}).encode()


def seeds(target: str) -> list[bytes]:
    """Inputs to start from: well-formed requests or answers behind control bytes that change nothing."""
    if target in ("server", "gateway"):
        control = bytes(16)  # no hang-up, no slow reading, no cuts
        post = _body(prompt="hello", max_tokens=4)
        stream = _body(messages=[{"role": "user", "content": "hi"}], stream=True)
        requests = [
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%b" % (len(post), post),
            b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
            % (len(stream), stream),
            b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n%b" % (len(post), post),
            b"GET /v1/models HTTP/1.1\r\n\r\nGET /stream HTTP/1.0\r\n\r\nHEAD /health HTTP/1.1\r\n\r\n",
            b"GET /slow HTTP/1.1\r\nX-Request-Id: abc\r\n\r\nGET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
        ]
        return [control + r for r in requests]
    if target == "replica":
        body = b'{"choices": []}'
        json_answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
            len(body), body)
        events = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
        sse_answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"%x\r\n%b\r\n0\r\n\r\n" % (len(events), events))

        def reply(answer: bytes, ending: int = 0) -> bytes:
            return bytes([ending]) + len(answer).to_bytes(2, "big") + bytes(9) + answer
        return [b"\x00\x00\x00\x00" + reply(json_answer),  # one request, one answer
                b"\x00\x01\x00\x01\x00\x01" + reply(sse_answer) + reply(sse_answer),  # two streamed requests
                b"\x01\x02\x01\x00\x00\x01\x02\x01" + reply(json_answer, 1) + reply(sse_answer, 2)
                + reply(json_answer, 4)]
    return [b"\x00" + _body(prompt="hi"), b"\x01" + _body(messages=[{"role": "user", "content": "x"}], n=2),
            b"\x02" + _body(input=["a", "b"])]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: python -m tests.fuzz.atheris_main {{{'|'.join(TARGETS)}}} [libFuzzer args]")
    target, args = argv[1], argv[2:]
    corpus = next((a for a in args if not a.startswith("-")), None)
    if corpus is None:
        corpus = tempfile.mkdtemp(prefix=f"atheris-{target}-")
        args.append(corpus)
    path = Path(corpus)
    if not path.is_file():
        path.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds(target)):
            (path / f"seed-{i}").write_bytes(seed)
    atheris.Setup([argv[0], *args], TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
