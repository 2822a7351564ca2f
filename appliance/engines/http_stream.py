"""Streamed completions from a vLLM server over plain HTTP/1.1 on this host (a Unix socket, or
TCP on the loopback), with no client library in between.

Owns the one request a proxied call makes (``POST /v1/completions`` with ``"stream": true``, its
answer a chunked server-sent-event stream) and its keep-alive connections: ``StreamPool.stream``
writes the request in one go, reads the answer as the bytes arrive (chunked or sized bodies),
and hands over the ``data:`` events of every complete line a read brought, as one batch, until
``[DONE]``. The connection goes back to the pool only once the answer has ended; whatever ends a
stream early (the caller cancelled, a batch it could not use, a broken answer) closes the
connection, which makes vLLM abort the request. A request on a kept-alive connection that the
server closed before answering is sent again once on a new one. What goes wrong on the wire is
``EngineUnavailable`` (retryable); an answer with a 4xx status is ``BadRequest``. Every other
call to the server (JSON routes, weight pushes) goes through ``ServerClient`` in
``appliance.engines.vllm_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import orjson

from contracts.errors import BadRequest, EngineUnavailable

#: Bytes read ahead of the consumer before the connection stops reading.
READ_AHEAD = 1 << 20
#: Seconds an answer's end may take to follow its ``[DONE]`` before the connection is dropped.
DRAIN_S = 5.0


class _Connection(asyncio.Protocol):
    """One kept-alive connection: the bytes received and not consumed yet, and whether the
    server closed it."""

    def __init__(self, on_lost: Callable[[_Connection], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        #: The answer being read may be followed by another request (HTTP/1.1, no "close").
        self.keep_alive = True
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        #: Reading stopped: the consumer is ``READ_AHEAD`` bytes behind.
        self.paused = False
        self._on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are no subclasses

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_AHEAD and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()
        self._on_lost(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self) -> bool:
        """Wait for bytes beyond those buffered; False if the connection closed instead."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        if self.closed:
            return False
        size = len(self.buffer)
        while len(self.buffer) == size and not self.closed:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return len(self.buffer) > size

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Broken(Exception):
    """The server closed the connection, or answered what is not HTTP/1.1; ``answered`` says
    whether any byte of an answer had come."""

    def __init__(self, reason: str, answered: bool) -> None:
        super().__init__(reason)
        self.answered = answered


class _Body:
    """Reads one answer's body off a connection: chunked, sized, or up to the close."""

    def __init__(self, conn: _Connection, chunked: bool, length: int | None) -> None:
        self._conn = conn
        self._chunked = chunked
        #: Bytes left in the current chunk (chunked) or the body (sized); None: to the close.
        self._left = length
        self._chunk_end = False  # a chunk's data has been read, its CRLF not yet
        self.ended = length == 0 and not chunked

    async def read(self) -> bytes:
        """The next bytes of the body (b"" once it has ended)."""
        conn = self._conn
        while not self.ended:
            # Nothing buffered takes nothing (and never ends a body): wait for bytes first.
            if conn.buffer:
                data = self._take()
                if data:
                    return data
                if self.ended:
                    break
            if not await conn.more():
                if self._left is None and not self._chunked:
                    self.ended = True
                    break
                raise _Broken("the connection closed in the middle of an answer", True)
        return b""

    def _take(self) -> bytes:
        """What the buffer holds of the body now (possibly nothing)."""
        buffer = self._conn.buffer
        if not self._chunked:
            if self._left is None:
                data = bytes(buffer)
                buffer.clear()
                return data
            data = bytes(buffer[: self._left])
            del buffer[: len(data)]
            self._left -= len(data)
            self.ended = self._left == 0
            return data
        out: list[bytes | bytearray] = []
        pos, n = 0, len(buffer)
        left, chunk_end = self._left or 0, self._chunk_end
        while True:
            if left:
                end = pos + left
                if end > n:  # the chunk goes on beyond what has come
                    if pos < n:
                        out.append(buffer[pos:n])
                    left -= n - pos
                    pos = n
                    break
                out.append(buffer[pos:end])
                pos, left, chunk_end = end, 0, True
            if chunk_end:
                if n - pos < 2:
                    break
                if buffer[pos] != 13 or buffer[pos + 1] != 10:
                    raise _Broken("a malformed chunk", True)
                pos += 2
                chunk_end = False
            end = buffer.find(b"\r\n", pos)
            if end < 0:
                break
            try:
                size = int(buffer[pos:end].split(b";", 1)[0], 16)
            except ValueError:
                raise _Broken("a malformed chunk size", True) from None
            if size == 0:  # the last chunk: no trailers expected, only the empty line
                last = buffer.find(b"\r\n\r\n", pos)
                if last < 0:
                    break
                pos = last + 4
                self.ended = True
                break
            pos, left = end + 2, size
        self._left, self._chunk_end = left, chunk_end
        del buffer[:pos]
        return b"".join(out)


class StreamPool:
    """Kept-alive connections to one server (``host``, ``port``; through the Unix socket
    ``unix_path`` when given), for streamed requests."""

    def __init__(self, host: str, port: int, unix_path: str | Path | None = None) -> None:
        self.host = host
        self.port = port
        self.unix_path = unix_path
        self._idle: list[_Connection] = []
        self._closed = False

    def close(self) -> None:
        """Close the idle connections; those in use close when their streams end."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _lost(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self.unix_path is not None:
            _, conn = await loop.create_unix_connection(lambda: _Connection(self._lost), str(self.unix_path))
        else:
            _, conn = await loop.create_connection(lambda: _Connection(self._lost), self.host, self.port)
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed or conn.closed or conn.buffer or not conn.keep_alive or conn.paused:
            conn.close()
        else:
            self._idle.append(conn)

    async def stream(self, path: str, body: bytes) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The ``data:`` events of the answer to ``POST path`` with the JSON ``body``, until
        ``[DONE]``, in batches: the events of the complete lines one read brought."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn: _Connection | None = None
        try:
            conn, status, response = await self._send(head, body)
            if status != 200:
                raise_for_status(status, (await _read_all(response)).decode(errors="replace"), path)
            async for events in sse_batches(response.read, path):
                yield events
            if await _ended(response):
                self._release(conn)
                conn = None
        except _Broken as exc:
            raise EngineUnavailable(f"the vLLM server broke off {path}: {exc}; retry shortly") from None
        except OSError as exc:
            raise EngineUnavailable(f"the vLLM server broke off {path}: {exc!r}; retry shortly") from exc
        finally:
            if conn is not None:
                # Cancelled, failed or left early: dropping the connection makes vLLM abort the
                # request (one kept alive would not).
                conn.close()

    async def _send(self, head: bytes, body: bytes) -> tuple[_Connection, int, _Body]:
        """Write the request and read the answer's head, on a kept-alive connection if there is
        one (sent again once on a new connection if the server had closed it unanswered)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or conn.buffer:  # closed by the server, or bytes nobody asked for
                conn.close()
                continue
            try:
                return conn, *await self._exchange(conn, head, body)
            except _Broken as exc:
                conn.close()
                if exc.answered:
                    raise
            except BaseException:
                conn.close()
                raise
        conn = await self._connect()
        try:
            return conn, *await self._exchange(conn, head, body)
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes) -> tuple[int, _Body]:
        assert conn.transport is not None
        conn.transport.writelines((head, body))
        buffer = conn.buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if not await conn.more():
                raise _Broken("the connection closed before an answer", bool(buffer))
        head_in = bytes(buffer[:end]).lower() + b"\r\n"
        del buffer[: end + 4]
        status_line = _STATUS.match(head_in)
        if status_line is None:
            raise _Broken(f"not an HTTP/1.1 answer: {head_in[:80]!r}", True)
        status = int(status_line[2])
        chunked = _CHUNKED.search(head_in) is not None
        length: int | None = None
        if (sized := _LENGTH.search(head_in)) is not None:
            if not sized[1].isdigit():
                raise _Broken(f"a malformed content-length {sized[1][:40]!r}", True)
            length = int(sized[1])
        reuse = status_line[1] == b"1" and _CLOSE.search(head_in) is None
        conn.keep_alive = reuse
        return status, _Body(conn, chunked, None if chunked else length)


#: In an answer's head, lower-cased and each line ending with CRLF: the status line (HTTP/1.x
#: and the code), a chunked body, a sized one, and "Connection: close".
_STATUS = re.compile(rb"http/1\.([01]) +(\d{3})\b")
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[^\r\n]*\bchunked\b")
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([^\r\n]*?)[ \t]*\r\n")
_CLOSE = re.compile(rb"\r\nconnection:[^\r\n]*\bclose\b")


async def _ended(body: _Body) -> bool:
    """After ``[DONE]``: whether the rest of the body (its end) came within ``DRAIN_S``, so the
    connection can take the next request. Nothing of it is needed: a body that does not end
    (or breaks off) only costs its connection."""
    if body.ended:
        return True
    try:
        async with asyncio.timeout(DRAIN_S):
            await _read_all(body)
    except (TimeoutError, _Broken):
        return False
    return True


async def _read_all(body: _Body) -> bytes:
    parts = []
    while data := await body.read():
        parts.append(data)
    return b"".join(parts)


async def sse_batches(read: Callable[[], Awaitable[bytes]], path: str) -> AsyncGenerator[list[Any], None]:
    """The ``data:`` events of a server-sent-event body that ``read`` returns as it arrives (b"":
    its end), until ``[DONE]``, in batches: the events of the lines one read completes (a
    partial last line waits for the next bytes). ``EngineUnavailable`` if the body ends first."""
    pending = b""
    while data := await read():
        if pending:
            data = pending + data
        end = data.rfind(b"\n")
        if end < 0:
            pending = data
            continue
        pending = data[end + 1 :]
        events, done = sse_events(data[:end], path)
        if events:
            yield events
        if done:
            return
    raise EngineUnavailable(f"the vLLM server ended the stream of {path} without [DONE]; retry")


def sse_events(text: bytes, path: str) -> tuple[list[Any], bool]:
    """The ``data:`` events among the complete lines ``text`` holds (a server-sent-event
    stream's), and whether ``[DONE]`` ended them (what follows it is left out). The events are
    decoded together, as one JSON array, unless one of them needs more than orjson reads."""
    if text.startswith(b"data:"):
        # One event (a paced stream's read brings one token's): no list of lines to build.
        end = text.find(b"\n")
        if end < 0 or not text[end + 1 :].strip():
            payload = text[5:end].strip() if end >= 0 else text[5:].strip()
            if payload == b"[DONE]":
                return [], True
            event = decode(payload)
            if "error" in event:
                raise_for_status(int(event["error"].get("code") or 500), payload.decode(), path)
            return [event], False
    payloads = [line[5:].strip() for line in text.split(b"\n") if line.startswith(b"data:")]
    done = b"[DONE]" in payloads
    if done:
        payloads = payloads[: payloads.index(b"[DONE]")]
    if not payloads:
        return [], done
    try:
        events = orjson.loads(b"[" + b",".join(payloads) + b"]")
    except orjson.JSONDecodeError:
        events = None
    if not isinstance(events, list) or len(events) != len(payloads):
        events = [decode(payload) for payload in payloads]
    for event, payload in zip(events, payloads, strict=True):
        if "error" in event:
            raise_for_status(int(event["error"].get("code") or 500), payload.decode(), path)
    return events, done


def decode(data: bytes) -> Any:
    """A JSON event: orjson, or Python's json for what orjson refuses (``NaN``, ``-Infinity``)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def raise_for_status(status: int, text: str, path: str) -> None:
    """``BadRequest`` for a 4xx answer, ``EngineUnavailable`` for a 5xx one, with its message."""
    if status < 400:
        return
    try:
        message = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = text[:500]
    if 400 <= status < 500:
        raise BadRequest(f"vLLM rejected {path}: {message}")
    raise EngineUnavailable(f"vLLM failed on {path} (HTTP {status}): {message}")
