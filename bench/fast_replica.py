"""A FAST fake vLLM replica for benchmarks: precomputed bytes, no JSON work, uvloop.

`POST /v1/completions` answers with `max_tokens` tokens (default 16); with `"stream": true`, one SSE event per
token: all in one write (back to back), or each its own write `bench_itl_ms` apart when the body asks for it (the
gateway passes that field through untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

MODEL = "fake-model"
CHUNK = (b'data: {"id":"cmpl-1","object":"text_completion","created":0,"model":"fake-model",'
         b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"


def _body(tokens: int) -> bytes:
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "text": " tok" * tokens, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 2, "completion_tokens": tokens,
                                 "total_tokens": tokens + 2}}).encode()


async def completions(request: web.Request) -> web.StreamResponse:
    body = json.loads(await request.read())
    tokens = int(body.get("max_tokens") or 16)
    if not body.get("stream"):
        return web.Response(body=_body(tokens), content_type="application/json")
    itl = float(body.get("bench_itl_ms") or 0) / 1000
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    try:
        await response.prepare(request)
        if not itl:  # back to back: every event in one write, as a static file from nginx arrives
            await response.write(CHUNK * tokens + DONE)
        else:
            for i in range(tokens):
                if i:
                    await asyncio.sleep(itl)
                await response.write(CHUNK)
            await response.write(DONE)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the load generator hung up at the end of its run
    return response


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def health(request: web.Request) -> web.Response:
    return web.Response()


def main() -> None:
    parser = argparse.ArgumentParser(description="A fast FAKE vLLM replica for benchmarks")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    import uvloop
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
