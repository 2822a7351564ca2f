"""The streamed-completion client against raw servers: chunked and sized answers cut anywhere,
kept-alive connections reused, a stale one replaced, errors, and a stream left early closing
its connection (which is how vLLM learns to abort)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from appliance.engines.http_stream import StreamPool, sse_events
from contracts.errors import BadRequest, EngineUnavailable

pytestmark = pytest.mark.asyncio

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def chunked(body: bytes, size: int) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


EVENTS = [{"choices": [{"token_ids": [i], "finish_reason": None}]} for i in range(5)]
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class Server:
    """A raw HTTP/1.1 server: each request on a connection is answered by ``reply``."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                await self.reply(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[Reply], Awaitable[tuple[Server, StreamPool]]]]:
    servers: list[asyncio.Server] = []
    pools: list[StreamPool] = []

    async def start(reply: Reply) -> tuple[Server, StreamPool]:
        server = Server(reply)
        raw = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        servers.append(raw)
        pool = StreamPool("127.0.0.1", raw.sockets[0].getsockname()[1])
        pools.append(pool)
        return server, pool

    yield start
    for pool in pools:
        pool.close()
    for raw in servers:
        raw.close()


async def collect(pool: StreamPool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async for batch in pool.stream("/v1/completions", b'{"stream": true}'):
        out.extend(batch)
    return out


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
async def test_a_chunked_stream_cut_anywhere_is_read_whole_and_the_connection_reused(
    serve: Callable[[Reply], Awaitable[tuple[Server, StreamPool]]], piece: int
) -> None:
    async def reply(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = CHUNKED_HEAD + chunked(sse(EVENTS), 13)
        for i in range(0, len(data), piece):
            writer.write(data[i : i + piece])
            await writer.drain()
            await asyncio.sleep(0)

    server, pool = await serve(reply)
    for _ in range(3):
        assert await collect(pool) == EVENTS
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert server.requests[0].endswith(b'\r\n\r\n{"stream": true}')


async def test_a_server_on_a_unix_socket_streams_over_it_and_keeps_the_connection(tmp_path: Path) -> None:
    async def reply(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunked(sse(EVENTS), 13))
        await writer.drain()

    server = Server(reply)
    path = str(tmp_path / "vllm.sock")
    raw = await asyncio.start_unix_server(server.handle, path)
    pool = StreamPool("localhost", 80, unix_path=path)
    try:
        for _ in range(3):
            assert await collect(pool) == EVENTS
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: localhost:80\r\n")
    finally:
        pool.close()
        raw.close()


async def test_a_sized_answer_and_a_closing_one_are_read(
    serve: Callable[[Reply], Awaitable[tuple[Server, StreamPool]]],
) -> None:
    body = sse(EVENTS)

    async def sized(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async def closing(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server, pool = await serve(sized)
    assert await collect(pool) == EVENTS and await collect(pool) == EVENTS
    assert server.connections == 1
    server, pool = await serve(closing)
    assert await collect(pool) == EVENTS and await collect(pool) == EVENTS
    assert server.connections == 2


async def test_a_kept_alive_connection_the_server_closed_is_replaced(
    serve: Callable[[Reply], Awaitable[tuple[Server, StreamPool]]],
) -> None:
    answered = 0

    async def reply(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        answered += 1
        if answered == 2:  # the second request: closed unanswered, like a keep-alive timeout
            writer.transport.abort()
            raise ConnectionError
        writer.write(CHUNKED_HEAD + chunked(sse(EVENTS), 50))
        await writer.drain()

    server, pool = await serve(reply)
    assert await collect(pool) == EVENTS
    assert await collect(pool) == EVENTS
    assert server.connections == 2


async def test_errors(serve: Callable[[Reply], Awaitable[tuple[Server, StreamPool]]]) -> None:
    message = json.dumps({"error": {"message": "prompt too long"}}).encode()

    async def rejected(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(message), message))
        await writer.drain()

    async def cut(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunked(sse(EVENTS), 20)[:40])
        await writer.drain()
        writer.transport.abort()

    async def no_done(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunked(b"data: {}\n\n", 50))
        await writer.drain()

    async def streamed_error(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunked(b'data: {"error": {"code": 500, "message": "boom"}}\n\n', 50))
        await writer.drain()

    _, pool = await serve(rejected)
    with pytest.raises(BadRequest, match="prompt too long"):
        await collect(pool)
    _, pool = await serve(cut)
    with pytest.raises(EngineUnavailable, match="broke off"):
        await collect(pool)
    _, pool = await serve(no_done)
    with pytest.raises(EngineUnavailable, match="without"):
        await collect(pool)
    _, pool = await serve(streamed_error)
    with pytest.raises(EngineUnavailable, match="boom"):
        await collect(pool)
    with pytest.raises(EngineUnavailable, match="broke off"):
        await collect(StreamPool("127.0.0.1", 1))


async def test_a_stream_left_early_or_cancelled_closes_its_connection(
    serve: Callable[[Reply], Awaitable[tuple[Server, StreamPool]]],
) -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunked(sse(EVENTS[:1])[:-14], 100)[:-5])  # no [DONE], no end
        await writer.drain()
        assert await reader.read(1) == b""  # until the client closes the connection
        raise ConnectionError

    server, pool = await serve(slow)
    stream = pool.stream("/v1/completions", b"{}")
    assert await anext(stream) == EVENTS[:1]
    await stream.aclose()
    await asyncio.wait_for(server.closed.wait(), 5)

    server, pool = await serve(slow)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in pool.stream("/v1/completions", b"{}"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.closed.wait(), 5)


async def test_an_answer_that_breaks_off_after_done_is_whole_and_its_connection_dropped(
    serve: Callable[[Reply], Awaitable[tuple[Server, StreamPool]]],
) -> None:
    async def cut_after_done(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunked(sse(EVENTS), 30)[:-5])  # [DONE], but not the last chunk
        await writer.drain()
        writer.transport.abort()

    server, pool = await serve(cut_after_done)
    assert await collect(pool) == EVENTS
    assert await collect(pool) == EVENTS
    assert server.connections == 2


@pytest.mark.parametrize(
    "text",
    [b'data: {"a":1}\n', b'data:{"a":1}', b'data: {"a":1}\n\n', b'data: {"a":1}\n\ndata: {"b":2}\n',
     b'data: {"a":1}\ndata: [DONE]\n', b"data: [DONE]\n", b'data: {"a":NaN}\n',
     b': comment\ndata: {"a":1}\n'],
)  # fmt: skip
async def test_one_event_reads_as_among_others(text: bytes) -> None:
    """A read of one event (a paced stream's) is parsed without the list of lines; the events,
    and whether ``[DONE]`` came, are those of the same text read among other events."""
    alone = sse_events(text, "/v1/completions")
    among = sse_events(text + b'\ndata: {"z":0}\n', "/v1/completions")
    if alone[1]:
        assert among == alone
    else:
        assert among == ([*alone[0], {"z": 0}], False)


async def test_an_error_event_alone_is_the_error() -> None:
    with pytest.raises(BadRequest, match="bad"):
        sse_events(b'data: {"error": {"code": 400, "message": "bad"}}\n', "/v1/completions")
