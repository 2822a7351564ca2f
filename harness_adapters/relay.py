"""An endpoint socket for a sandboxed rollout when the proxy offers none of its own.

Owns one thing: a Unix socket, in a private directory, whose connections are relayed byte for
byte to the rollout's TCP endpoint (the host and port of its base URL). The appliance's proxy
serves each sandboxed rollout on a socket of its own (``ClientConfig.endpoint_socket``), which
answers nothing but that rollout's routes; an adapter used on its own (a script, a test, a
server that is not the appliance's proxy) gets this relay instead, so that a sandbox without a
network still reaches its model. Use it as ``async with EndpointRelay.open(base_url) as path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from harness_adapters.sandbox import host_and_port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


class EndpointRelay:
    @staticmethod
    @contextlib.asynccontextmanager
    async def open(base_url: str) -> AsyncIterator[Path]:
        """A Unix socket relayed to ``base_url``'s host and port, for the life of the block."""
        host, port = host_and_port(base_url)
        connections: set[asyncio.Task[None]] = set()

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
            except OSError:
                writer.close()
                return
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                for end in (writer, up_writer):
                    end.close()

        def track(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.create_task(relay(reader, writer))
            connections.add(task)
            task.add_done_callback(connections.discard)

        directory = Path(tempfile.mkdtemp(prefix="la-relay-"))
        path = directory / "endpoint.sock"
        server = await asyncio.start_unix_server(track, path=str(path))
        try:
            yield path
        finally:
            server.close()
            for task in list(connections):
                task.cancel()
            await asyncio.gather(*connections, return_exceptions=True)
            with contextlib.suppress(Exception):
                await server.wait_closed()
            shutil.rmtree(directory, ignore_errors=True)
