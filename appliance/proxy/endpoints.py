"""Per-rollout endpoint sockets: how a sandboxed rollout reaches the proxy, and nothing else.

Owns one Unix socket per sandboxed rollout, served by the proxy's own application (an aiohttp
``UnixSite`` on the proxy's runner: the same handlers, no extra hop), and the middleware that
holds each socket to its rollout: a request that comes in through rollout R's socket is served
only on R's routes (``/rollouts/R/...``: its model calls, its reward); anything else (the admin
API, ``/metrics``, the rollout-less ``/v1``, another rollout's routes) is a 403, whatever
credentials it carries. A sandbox binds its rollout's socket and relays its loopback URL to it
(``harness_adapters.sandbox``), so this socket is the rollout's whole network.

Sockets live in a private directory (0700) under the system's temporary directory: a Unix
socket's path is limited to 107 bytes, which a data directory's path could pass. A socket is
removed when its rollout ends and the directory when the proxy closes.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from aiohttp import web

from appliance.proxy.http import Handler
from contracts.errors import Forbidden

SOCKETS: web.AppKey[RolloutSockets] = web.AppKey("rollout_sockets")


class RolloutSockets:
    """The sockets of the running sandboxed rollouts, on one proxy's runner."""

    def __init__(self, runner: web.AppRunner) -> None:
        self._runner = runner
        self._directory: Path | None = None
        self._sites: dict[str, tuple[web.UnixSite, Path]] = {}
        #: Socket path -> the rollout it serves.
        self._owners: dict[str, str] = {}
        self._count = 0

    def rollout_of(self, socket_path: str) -> str | None:
        return self._owners.get(socket_path)

    async def open(self, rollout: str) -> Path:
        """A new socket serving ``rollout`` only; its path."""
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="la-endpoints-"))
            self._directory.chmod(0o700)
        if rollout in self._sites:
            raise ValueError(f"rollout {rollout!r} already has an endpoint socket")
        self._count += 1
        path = self._directory / f"{self._count}.sock"
        site = web.UnixSite(self._runner, str(path))
        await site.start()
        self._sites[rollout] = (site, path)
        self._owners[str(path)] = rollout
        return path

    async def close(self, rollout: str) -> None:
        entry = self._sites.pop(rollout, None)
        if entry is None:
            return
        site, path = entry
        self._owners.pop(str(path), None)
        with contextlib.suppress(RuntimeError):
            await site.stop()
        path.unlink(missing_ok=True)

    async def close_all(self) -> None:
        for rollout in list(self._sites):
            await self.close(rollout)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def __len__(self) -> int:
        return len(self._sites)


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Serve a request that came through a rollout's socket only on that rollout's routes."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(sockname, str):  # TCP: a (host, port) tuple
        return await handler(request)
    sockets = request.app.get(SOCKETS)
    rollout = sockets.rollout_of(sockname) if sockets is not None else None
    if rollout is None or not request.path.startswith(f"/rollouts/{rollout}/"):
        raise Forbidden("a sandboxed rollout reaches its own routes only (/rollouts/<its id>/...)")
    return await handler(request)
