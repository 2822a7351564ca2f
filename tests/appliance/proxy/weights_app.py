"""A real aiohttp server holding the proxy's weight routes (``appliance.proxy.weights``) behind
the proxy's own error middleware and admin token, serving a ``WeightPublication``: what a
replica on another machine pulls from, without the rest of the appliance."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from appliance.engines.weight_publication import WeightPublication
from appliance.proxy import weights
from appliance.proxy.http import SETTINGS, ProxySettings
from appliance.proxy.server import errors_middleware

TOKEN = "admin-token-for-weights"


@contextlib.asynccontextmanager
async def weights_server(publication: WeightPublication, token: str = TOKEN) -> AsyncIterator[str]:
    """The server's URL (``http://127.0.0.1:<port>``, a port of its own) while the block runs."""
    app = web.Application(middlewares=[errors_middleware])
    app[SETTINGS] = ProxySettings(
        model_name="policy",
        max_tokens_default=None,
        max_tokens_cap=64,
        temperature_override=None,
        admin_token=token,
    )
    weights.add_routes(app)
    weights.serve(app, publication)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
