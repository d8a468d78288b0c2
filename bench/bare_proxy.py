"""A bare aiohttp round-robin proxy: the reference the gateway's overhead is compared with.

No parsing, no accounting, no health checks, no metrics, no retries: read the body, forward it, relay the answer
(streamed when it is SSE). `python bench/bare_proxy.py --port P --replica URL [--replica URL ...]`
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator, Iterator

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
REPLICAS = web.AppKey("replicas", Iterator[str])


async def _session(app: web.Application) -> AsyncIterator[None]:
    # limit=0: aiohttp's default of 100 upstream connections would throttle hundreds of concurrent streams
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60))
    yield
    await app[SESSION].close()


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = next(request.app[REPLICAS]) + request.path
    async with request.app[SESSION].post(url, data=body, headers={"Content-Type": "application/json"}) as upstream:
        if upstream.content_type != "text/event-stream":
            return web.Response(body=await upstream.read(), status=upstream.status, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for data in upstream.content.iter_any():
            await response.write(data)
        await response.write_eof()
        return response


async def _health(request: web.Request) -> web.Response:
    return web.Response()


def main() -> None:
    parser = argparse.ArgumentParser(description="a bare aiohttp round-robin proxy (benchmark reference)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", action="append", required=True)
    args = parser.parse_args()
    app = web.Application()
    app[REPLICAS] = itertools.cycle(args.replica)
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/{tail:.*}", forward)
    app.router.add_get("/health", _health)
    import uvloop
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
