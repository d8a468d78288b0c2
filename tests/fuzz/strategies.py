"""Hypothesis strategies for the fuzz harnesses: HTTP requests and answers built from parts, then mutated and split.

Built from parts so most inputs get deep (a valid head, a body by length or by chunks, a JSON body with fields of
every type), then mutated (bytes flipped, inserted, dropped, repeated, tokens that matter to HTTP parsers put in)
so the odd cases are reached too.
"""

from __future__ import annotations

import itertools

import json
import re
from typing import Any

from hypothesis import strategies as st

from .harness import MODEL, ClientRequest, Reply

TOKENS = (b"\r\n", b"\n", b"\r", b"\r\n\r\n", b":", b" ", b"\t", b"\x00", b"\xff", b"0\r\n\r\n", b"chunked",
          b"Content-Length: ", b"Transfer-Encoding: chunked\r\n", b"HTTP/1.1", b"GET / HTTP/1.1\r\n\r\n",
          b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"999999999999999999999", b"-1", b"data: ",
          b"\n\n", b"[DONE]", b'"stream": true', b"{", b"}", b'"', b"\\u0000")
METHODS = ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT", "TRACE", "PRI")
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/v1/other", "/health", "/ready",
         "/metrics", "/slow", "/stream", "/", "/v1/completions?x=1", "/v1/", "*", "http://host/v1/completions",
         "/v1/completions/", "/%2e%2e/x", "/v1/models#f")


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                        st.floats(allow_nan=False), st.text(max_size=20))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


@st.composite
def request_bodies(draw: st.DrawFn) -> bytes:
    """A JSON request body: mostly the fields the gateway reads, with values of every type."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    body: dict[str, Any] = {}
    if draw(st.integers(0, 5)):
        body["model"] = draw(st.one_of(st.just(MODEL), st.sampled_from(["", "other", "m "]), _json_values()))
    choice = draw(st.integers(0, 2))
    text_or_ids = st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 50_000), max_size=5),
                            st.lists(st.text(max_size=5), max_size=3), _json_values())
    if choice == 0:
        body["prompt"] = draw(text_or_ids)
    elif choice == 1:
        body["messages"] = draw(st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                            "content": st.one_of(st.text(max_size=20), _json_values())}),
                     max_size=3), _json_values()))
    else:
        body["input"] = draw(text_or_ids)
    for name in ("max_tokens", "max_completion_tokens", "n", "stream"):
        if draw(st.booleans()):
            body[name] = draw(st.one_of(st.integers(-3, 2**40), st.booleans(), _json_values()))
    if draw(st.integers(0, 3)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=8), _json_values(), max_size=3)))
    return json.dumps(body).encode()


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    """One HTTP request built from parts: method, target, version, headers, body by length or by chunks."""
    method = draw(st.one_of(st.sampled_from(METHODS), st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=8)))
    target = draw(st.one_of(st.sampled_from(PATHS), st.text(st.characters(min_codepoint=33, max_codepoint=126),
                                                                  min_size=1, max_size=20)))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]))
    body = draw(request_bodies()) if draw(st.integers(0, 3)) else b""
    headers: list[tuple[str, str]] = []
    if draw(st.booleans()):
        headers.append(("Host", "gw"))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "wrong-length"]))
    if framing == "length":
        headers.append(("Content-Length", str(len(body))))
    elif framing == "wrong-length":
        headers.append(("Content-Length", str(max(0, len(body) + draw(st.integers(-20, 20))))))
    elif framing == "chunked":
        headers.append(("Transfer-Encoding", "chunked"))
    optional = [("Content-Type", "application/json"), ("Expect", "100-continue"), ("Connection", "close"),
                ("Connection", "keep-alive"), ("Connection", "upgrade"), ("Upgrade", "websocket"),
                ("X-Request-Id", draw(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40))),
                ("Authorization", "Bearer k"), ("Content-Length", "5"), ("Transfer-Encoding", "gzip, chunked"),
                ("X-Big", "x" * draw(st.sampled_from([10, 5000, 70000])))]
    headers += draw(st.lists(st.sampled_from(optional), max_size=3))
    head = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    if framing == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if b > a]
        body = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return head.encode("latin-1") + body


@st.composite
def mutated(draw: st.DrawFn, data: bytes, max_mutations: int = 3) -> bytes:
    """`data` with up to `max_mutations` edits: a byte changed, a token or random bytes put in, a range dropped
    or repeated, the end cut off."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(0, max_mutations))):
        at = draw(st.integers(0, len(buf)))
        kind = draw(st.integers(0, 5))
        if kind == 0 and buf:
            buf[min(at, len(buf) - 1)] = draw(st.integers(0, 255))
        elif kind == 1:
            buf[at:at] = draw(st.sampled_from(TOKENS))
        elif kind == 2:
            buf[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == 3:
            buf[at:at + draw(st.integers(1, 16))] = b""
        elif kind == 4:
            end = min(len(buf), at + draw(st.integers(1, 64)))
            buf[at:at] = buf[at:end]
        else:
            del buf[at:]
    return bytes(buf)


@st.composite
def split(draw: st.DrawFn, data: bytes, max_pieces: int = 8) -> tuple[list[bytes], list[float]]:
    """`data` cut at random points, with a pause before each piece (mostly none, some past the timeouts)."""
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=max_pieces - 1))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]) if b > a]
    gaps = [draw(st.sampled_from([0.0, 0.0, 0.0, 0.001, 0.05, 1.0, 2.5, 6.0])) for _ in pieces]
    return pieces, gaps


@st.composite
def client_streams(draw: st.DrawFn) -> tuple[list[bytes], list[float]]:
    """What one client connection sends: a few requests (pipelined or not), maybe mutated, maybe random bytes."""
    if draw(st.integers(0, 9)) == 0:
        data = draw(st.binary(max_size=300))
    else:
        data = b"".join(draw(st.lists(http_requests(), min_size=1, max_size=4)))
        data = draw(mutated(data))
    return draw(split(data))


# -- replica answers -----------------------------------------------------------------------------------------------
@st.composite
def replica_answers(draw: st.DrawFn) -> bytes:
    """One answer a replica might give: a status, JSON or SSE, by length, by chunks or up to the close."""
    status = draw(st.sampled_from(["200 OK", "200 OK", "200 OK", "100 Continue", "400 Bad Request", "404 Not Found",
                                   "500 Internal Server Error", "502 Bad Gateway", "503 Service Unavailable"]))
    sse = draw(st.booleans())
    if sse:
        events = draw(st.lists(st.sampled_from([b'data: {"choices": [{"index": 0, "text": " tok"}]}\n\n',
                                                b"data: [DONE]\n\n", b": keep-alive\n\n", b"data: {\n\n",
                                                b'data: {"error": {"message": "x"}}\n\n']), max_size=6))
        body = b"".join(events)
    else:
        body = draw(st.sampled_from([b'{"choices": [{"index": 0, "text": " tok"}]}', b"", b"not json",
                                     b'{"error": {"message": "bad"}}']))
    headers = [f"Content-Type: {'text/event-stream' if sse else 'application/json'}"]
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if framing == "length":
        headers.append(f"Content-Length: {len(body)}")
    elif framing == "chunked":
        headers.append("Transfer-Encoding: chunked")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if b > a]
        body = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    if draw(st.integers(0, 4)) == 0:
        headers.append("Connection: close")
    head = f"HTTP/1.1 {status}\r\n" + "".join(f"{h}\r\n" for h in headers) + "\r\n"
    answer = head.encode() + body
    if status.startswith("100"):
        answer += draw(replica_answers())
    return answer


@st.composite
def chunked_streams(draw: st.DrawFn) -> tuple[bytes, Reply]:
    """A well-formed SSE stream in chunks (sizes in either case, some with extensions), sent in reads cut mostly at
    chunk boundaries (each read then one or more whole chunks, as vLLM's tokens arrive) and sometimes inside one;
    with the body the client must get."""
    events = draw(st.lists(st.sampled_from([b'data: {"choices": [{"index": 0, "text": " tok"}]}\n\n',
                                            # cut after "data: ", the rest looks like a whole chunk of its own
                                            b"data: 3\r\n2\n\n", b": keep-alive\n\n", b"data: [DONE]\n\n"]),
                           min_size=1, max_size=8))
    body = b"".join(events)
    cuts = sorted(set(draw(st.lists(st.integers(1, len(body)), max_size=3))) | set(itertools.accumulate(map(len, events))))
    chunks = []
    for a, b in zip([0, *cuts], cuts):
        size = draw(st.sampled_from([b"%x", b"%X", b"%04x"])) % (b - a)
        chunks.append(size + draw(st.sampled_from([b"", b"", b";x=1"])) + b"\r\n" + body[a:b] + b"\r\n")
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    wire = [head, *chunks, b"0\r\n\r\n"]
    pieces, piece = [], b""
    for part in wire:
        piece += part
        if draw(st.integers(0, 3)):  # a read ends here
            pieces.append(piece)
            piece = b""
    pieces.append(piece)
    inside = [p for p in pieces if p]
    if draw(st.booleans()):  # one read cut inside
        i = draw(st.integers(0, len(inside) - 1))
        after_field = [m.end() for m in re.finditer(rb"data: ", inside[i])]
        at = draw(st.sampled_from(after_field) if after_field and draw(st.booleans())
                  else st.integers(1, max(1, len(inside[i]) - 1)))
        inside[i:i + 1] = [inside[i][:at], inside[i][at:]] if len(inside[i]) > 1 else [inside[i]]
    return body, Reply(tuple(inside), tuple(draw(st.sampled_from([0.0, 0.001])) for _ in inside))


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    """A fuzzed answer, split and paused, then an ending (kept, closed, reset, silent, or followed by more)."""
    data = draw(mutated(draw(replica_answers()), max_mutations=2))
    pieces, gaps = draw(split(data, max_pieces=5))
    ending = draw(st.sampled_from(["keep", "keep", "close", "reset", "silent", "extra"]))
    return Reply(tuple(pieces), tuple(gaps), ending)


client_requests = st.builds(ClientRequest, st.sampled_from(["/v1/completions", "/v1/chat/completions",
                                                             "/v1/other"]), st.booleans())
