"""The pass-through relay of scripts/bench_proxy.py ``--history``: its own process, the floor of
what any proxy in front of the upstream pays for a long conversation.

Owns the server and nothing else. Each chat completion's body is read and sent on to the fake
upstream's own ``/v1/chat/completions`` as it came (over the upstream's Unix socket, as the
appliance reaches it), and the upstream's answer goes back as it came: the bytes of a conversation
move in and out once, nothing is parsed, rendered or recorded. What it costs per call as a
conversation grows is what the conversation's bytes cost on this machine (the kernel's copies,
the HTTP layer's reads), beside which the appliance's growth is measured.

    python scripts/bench_proxy_relay.py UPSTREAM_SOCKET

prints ``{"port": N}`` once it listens on 127.0.0.1, then serves until it is terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
from aiohttp import web


def relay_app(upstream_socket: str) -> web.Application:
    """An app that relays ``POST /v1/chat/completions`` to the upstream at ``upstream_socket``."""
    app = web.Application(client_max_size=1 << 28)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def session_context(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.UnixConnector(upstream_socket, limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            app[session_key] = session
            yield

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        session = request.app[session_key]
        async with session.post("http://localhost/v1/chat/completions", data=body, headers=headers) as answer:
            return web.Response(body=await answer.read(), status=answer.status, headers=headers)

    app.cleanup_ctx.append(session_context)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def serve(upstream_socket: str) -> None:
    runner = web.AppRunner(relay_app(upstream_socket), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    print(json.dumps({"port": runner.addresses[0][1]}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("upstream_socket", help="the fake upstream's Unix socket")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.upstream_socket))
