"""The event store: an append-only log of events in one SQLite file.

Owns opening (creating, migrating, verifying) a store, the reader connection that serves ``read``
and ``subscribe``, the read-only readers of a log by path, and the verification of its checksum
chain. It does not own the SQL schema and its migrations (``store.schema``), rebuilding what a
row shares with an earlier call (``store.reading``), the writer thread and its transactions
(``store.writer``), how an event becomes a row (``store.codec``) nor what the events mean
(``store.projections``).

Invariants:

* Positions are 1, 2, 3, ... without gaps, in commit order. Only this process writes: the writer
  keeps the next position in memory and checks, inside each transaction, that nobody else
  moved the end of the log.
* ``append`` returns only after the transaction holding its events is durable (WAL with
  ``synchronous=FULL``): an acknowledged event survives a crash or power loss. The events of one
  ``append`` call are committed together or not at all.
* Appends that queue up while a commit is in flight are committed together in the next
  transaction (group commit), run whole by one writer thread: one fsync serves many callers.
  If that transaction fails, every caller in it gets :class:`StoreError` (:class:`StoreFull`
  when the disk is full) and nothing of the batch is in the log.
* Every row carries ``chain``, the checksum of its columns chained over the previous row's
  (``store.codec.chain_digest``). Opening a store for writing verifies the whole chain
  (:func:`verify_log`) and refuses a log that was changed, truncated inside, or has a gap
  (:class:`StoreCorrupted`). Schema version 1 stores (no checksums) get them on that open.
* A clean ``close`` of the writer checkpoints the WAL (``wal_checkpoint(TRUNCATE)``): the main
  file alone then holds every event, so copying ``events.sqlite`` copies the run's log (a live
  store is copied with ``appliance.operations.backup``).
* A call's prompt that starts with the previous call of its rollout is stored as a reference to
  that call plus the new suffix (``store.codec.share_prefix``), and its request's conversation as
  the messages after those of that call's request (``store.codec.share_request``); reads rebuild
  both, so the events read back are the events appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sqlite3
from collections import deque
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite

from contracts.errors import StoreCorrupted, StoreError
from store.codec import EncodedEvent, StoredEvent, as_stored, chain_digest
from store.events import Event, LLMCallCompleted
from store.reading import RowDecoder, check_progress, merge, select_sync
from store.schema import (
    BUSY_TIMEOUT,
    CALLS_BETWEEN,
    CHAIN_PAGE,
    CHAINED,
    CHAINED_VERSION,
    COLUMNS,
    GET_VERSION,
    HAS_META,
    TAIL,
    Row,
    cap_size,
    check_version,
    connect_readonly,
    connect_writer,
    readonly_uri,
)
from store.writer import COMMIT_BUCKETS_S, MAX_BATCH_EVENTS, Committed, Pending, Writer, store_error

__all__ = [
    "MAX_BATCH_EVENTS",
    "ChainReport",
    "EventStore",
    "StoredEvent",
    "iter_events_sync",
    "read_calls_sync",
    "read_events_sync",
    "read_last_sync",
    "verify_log",
]

#: Events fetched per query by ``subscribe``.
_PAGE = 512
#: A read-only store sees other processes' commits only by looking again, this often (seconds).
_READONLY_POLL_S = 0.5
#: The latest commits a writer keeps in memory for its subscribers, so that one keeping up gets
#: each new event without reading and decoding it again: at most this many events and this many
#: tokens of calls' prompts (a subscriber further behind reads the log).
_RECENT_EVENTS = 1024
_RECENT_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class ChainReport:
    """What :func:`verify_log` checked: every row's checksum, chained, positions 1..``events``."""

    events: int
    #: The last row's checksum (b"" for an empty log): the next row chains over it.
    digest: bytes


class EventStore:
    """Append-only event log over SQLite. Build it with ``await EventStore.open(path)``."""

    def __init__(
        self,
        path: Path,
        writer: sqlite3.Connection | None,
        reader: aiosqlite.Connection,
        tail: ChainReport,
        *,
        share_prefixes: bool = True,
    ) -> None:
        self.path = path
        self.readonly = writer is None
        self._reader = reader
        self._head = tail.events
        self._decoder = RowDecoder()
        #: Set (and replaced) at every commit and at close: what subscribers wait on.
        self._committed = asyncio.Event()
        self._accepting = writer is not None
        self._closed = False
        self._close_task: asyncio.Future[None] | None = None
        self._writer: Writer | None = None
        #: Appends of this turn of the event loop, not yet handed to the writer.
        self._outbox: list[Pending] = []
        #: The latest committed events, positions without gaps (see ``_RECENT_EVENTS``).
        self._recent: deque[Committed] = deque()
        self._recent_tokens = 0
        if writer is not None:
            self._writer = Writer(
                writer, path, tail.events, tail.digest, share=share_prefixes, on_commit=self._on_commit
            )
            self._writer.start()

    @property
    def commits(self) -> int:
        """Transactions committed by this instance (one per group commit)."""
        return 0 if self._writer is None else self._writer.commits

    @property
    def writer_seconds(self) -> tuple[float, float]:
        """Seconds the writer thread spent (preparing batches, in their SQL), for benchmarks."""
        return (0.0, 0.0) if self._writer is None else (self._writer.prepare_s, self._writer.sql_s)

    @property
    def commit_latency(self) -> tuple[list[int], float]:
        """Transactions committed by this instance, counted by SQL time in the buckets of
        ``store.writer.COMMIT_BUCKETS_S`` (the last count: longer), and their seconds in all."""
        if self._writer is None:
            return [0] * (len(COMMIT_BUCKETS_S) + 1), 0.0
        return list(self._writer.commit_buckets), self._writer.committed_s

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        readonly: bool = False,
        verify: bool = True,
        share_prefixes: bool = True,
        max_bytes: int | None = None,
    ) -> EventStore:
        """Open (creating it unless ``readonly``) the store at ``path``.

        A writer first verifies the checksum chain of the whole log unless ``verify`` is False
        (readers never do; they call :meth:`verify`). ``share_prefixes=False`` stores every
        call's tokens and request whole. ``max_bytes`` caps the database file: appends that would grow it
        further fail with :class:`StoreFull`, as on a full disk.
        """
        if readonly and not await asyncio.to_thread(Path(path).is_file):
            raise StoreError(f"cannot open event store {path} read-only: no such file")
        async with contextlib.AsyncExitStack() as stack:
            try:
                writer = None
                if not readonly:
                    writer = await asyncio.to_thread(connect_writer, path, max_bytes)
                    stack.callback(writer.close)
                reader = await aiosqlite.connect(readonly_uri(path), uri=True, isolation_level=None)
                stack.push_async_callback(reader.close)
                await reader.execute(BUSY_TIMEOUT)
                has_meta = bool(await reader.execute_fetchall(HAS_META))
                check_version(path, list(await reader.execute_fetchall(GET_VERSION)) if has_meta else [])
                if writer is not None and verify:
                    tail = await asyncio.to_thread(verify_log, path)
                else:
                    tail = await _tail(reader)
            except sqlite3.Error as exc:
                raise store_error(f"cannot open event store {path}", exc) from exc
            stack.pop_all()
        return cls(path, writer, reader, tail, share_prefixes=share_prefixes)

    async def set_max_bytes(self, max_bytes: int | None) -> None:
        """Cap the database file at about ``max_bytes`` (None: no cap); see ``open``.

        A cap below the current size holds the store at its current size.
        """
        if self._writer is None or not self._accepting:
            raise StoreError(f"event store {self.path} is not open for writing: cannot cap its size")
        try:
            await self._writer.call(lambda conn: cap_size(conn, max_bytes))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot cap the size of event store {self.path}: {exc}") from exc

    async def verify(self) -> ChainReport:
        """Check the checksum chain of every durable event; raise :class:`StoreCorrupted` if broken."""
        if self._closed:
            raise StoreError(f"event store {self.path} is closed: cannot verify")
        return await asyncio.to_thread(verify_log, self.path)

    @property
    def last_position(self) -> int:
        """Position of the last durable event (0 for an empty log).

        A read-only store learns of other processes' commits only through ``read``/``subscribe``.
        """
        return self._head

    async def append(self, events: Sequence[Event]) -> list[int]:
        """Make ``events`` durable, all or none, and return their positions in order."""
        if self.readonly:
            raise StoreError(f"event store {self.path} is open read-only: cannot append")
        if not self._accepting:
            raise StoreError(f"event store {self.path} is closed: cannot append")
        if not events:
            return []
        assert self._writer is not None
        pending = Pending(events, asyncio.get_running_loop().create_future())
        self._outbox.append(pending)
        if len(self._outbox) == 1:  # hand this turn's appends to the writer together, after it
            asyncio.get_running_loop().call_soon(self._flush)
        # A caller cancelled from here on does not withdraw its events: they may still commit.
        return await pending.future

    async def read(
        self,
        after: int = 0,
        *,
        limit: int | None = None,
        types: Collection[str] | None = None,
        rollout: str | None = None,
    ) -> list[StoredEvent]:
        """Durable events with position > ``after``, in order, optionally filtered."""
        if self._closed:
            raise StoreError(f"event store {self.path} is closed: cannot read")
        sql = f"SELECT {COLUMNS} FROM events WHERE position > ?"
        params: list[Any] = [after]
        if types is not None:
            sql += f" AND type IN ({', '.join('?' * len(types))})"
            params += list(types)
        if rollout is not None:
            sql += " AND rollout = ?"
            params.append(rollout)
        sql += " ORDER BY position"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        try:
            rows: list[Row] = list(await self._reader.execute_fetchall(sql, params))
            stored = await self._decode(rows)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read event store {self.path}: {exc}") from exc
        if self.readonly and stored:  # another process writes: learn how far the log has grown
            self._head = max(self._head, stored[-1].position)
        return stored

    async def subscribe(self, after: int = 0) -> AsyncIterator[StoredEvent]:
        """Every event after ``after`` in order: the backlog, then each new one as it commits.

        Ends when the store closes (events committed but not yet yielded by then are not).
        """
        position = after
        while not self._closed:
            page = self._recently_committed(position)
            if page is None:
                page = await self.read(position, limit=_PAGE)
            for stored in page:
                yield stored
                position = stored.position
            if len(page) < _PAGE:
                await self._wait_past(position)

    async def close(self) -> None:
        """Stop accepting appends, commit what is queued, close connections, end subscriptions.

        Idempotent; concurrent callers all wait for the same shutdown.
        """
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- internals ---------------------------------------------------------------------------

    async def _decode(self, rows: list[Row]) -> list[StoredEvent]:
        """Decode ``rows``, first fetching the earlier calls their shared prefixes refer to."""
        wanted = {row[0] for row in rows}
        merged, last_need = rows, None
        while (need := self._decoder.missing(merged)) is not None:
            check_progress(self.path, need, last_need)
            last_need = need
            merged = merge(merged, await self._reader.execute_fetchall(CALLS_BETWEEN, need))
        return [s for s in self._decoder.decode(merged) if s.position in wanted]

    async def _close(self) -> None:
        self._accepting = False
        if self._writer is not None:
            self._flush()
            await self._writer.stop()
        self._closed = True
        self._signal()
        try:
            await self._reader.close()
            if self._writer is not None:
                await asyncio.to_thread(self._writer.close)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot close event store {self.path}: {exc}") from exc

    def _flush(self) -> None:
        if self._outbox and self._writer is not None:
            self._writer.submit(self._outbox)
            self._outbox = []

    def _on_commit(self, head: int, committed: Sequence[Committed]) -> None:
        """In the event loop, after the writer committed ``committed``, a batch ending at ``head``."""
        self._head = head
        recent = self._recent
        for entry in committed:
            recent.append(entry)
            self._recent_tokens += _tokens(entry[1])
        while recent and (len(recent) > _RECENT_EVENTS or self._recent_tokens > _RECENT_TOKENS):
            self._recent_tokens -= _tokens(recent.popleft()[1])
        self._signal()

    def _recently_committed(self, after: int) -> list[StoredEvent] | None:
        """Up to ``_PAGE`` events after ``after`` from memory, as ``read`` would return them, or
        None when memory no longer holds the next one."""
        recent = self._recent
        if not recent or recent[0][0] > after + 1:
            return None
        start = after + 1 - recent[0][0]
        end = min(len(recent), start + _PAGE)
        if start >= end:
            return []
        # A deque is walked from an end: from the right for a subscriber that keeps up (it wants
        # the last few of up to _RECENT_EVENTS), so that costs what it reads, not what is held.
        if end > len(recent) - start:
            page = list(itertools.islice(reversed(recent), len(recent) - end, len(recent) - start))
            page.reverse()
        else:
            page = list(itertools.islice(recent, start, end))
        return [StoredEvent(position, as_stored(event, row)) for position, event, row in page]

    def _signal(self) -> None:
        self._committed.set()
        self._committed = asyncio.Event()

    async def _wait_past(self, position: int) -> None:
        if self.readonly:  # other processes' commits show only by looking again
            if not self._closed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._committed.wait(), _READONLY_POLL_S)
            return
        while not (self._closed or self._head > position):
            await self._committed.wait()


def verify_log(path: Path) -> ChainReport:
    """Check every row's checksum and that positions run 1..N; raise StoreCorrupted if not.

    Reads with stdlib sqlite3, read-only, page by page; safe while another process appends.
    """
    digest, expected = b"", 1
    try:
        conn, version = connect_readonly(path)
        with contextlib.closing(conn):
            if version < CHAINED_VERSION:
                raise StoreError(
                    f"event store {path} has no checksums yet (schema version {version}):"
                    " open it for writing once to add them"
                )
            conn.execute("BEGIN")  # one snapshot for all pages
            while rows := conn.execute(CHAINED, (expected - 1, CHAIN_PAGE)).fetchall():
                for position, type_name, version, rollout, ts, data, blob, chain in rows:
                    if position != expected:
                        raise StoreCorrupted(
                            f"event store {path} is corrupted: position {expected} is missing"
                            f" (the next event is at {position})"
                        )
                    row = EncodedEvent(type_name, version, rollout, ts, data, bytes(blob))
                    digest = chain_digest(digest, position, row)
                    if chain is None or bytes(chain) != digest:
                        raise StoreCorrupted(
                            f"event store {path} is corrupted at position {position}: its checksum"
                            " does not match its contents and the events before it; restore the"
                            " data directory from a backup"
                        )
                    expected += 1
    except sqlite3.Error as exc:
        raise StoreError(f"cannot verify event store {path}: {exc}") from exc
    return ChainReport(expected - 1, digest)


def read_events_sync(path: Path, *, after: int = 0, limit: int | None = None) -> list[StoredEvent]:
    """Read the log (from ``after``, at most ``limit`` events) with stdlib sqlite3, read-only.

    Safe while another process appends (WAL readers see the last committed state).
    """
    return _read_sync(path, after, limit, RowDecoder())


def iter_events_sync(path: Path, *, after: int = 0, page: int = _PAGE) -> Iterator[StoredEvent]:
    """Every event after ``after``, in order, read ``page`` events at a time: a fold of a long
    log holds one page of events at once, not the whole log (read-only like
    :func:`read_events_sync`; the shared prompts of one page are remembered for the next)."""
    decoder = RowDecoder()
    while True:
        found = _read_sync(path, after, page, decoder)
        yield from found
        if len(found) < page:
            return
        after = found[-1].position


def _read_sync(path: Path, after: int, limit: int | None, decoder: RowDecoder) -> list[StoredEvent]:
    sql = f"SELECT {COLUMNS} FROM events WHERE position > ? ORDER BY position"
    if limit is None:
        return select_sync(path, sql, (after,), decoder)
    return select_sync(path, sql + " LIMIT ?", (after, limit), decoder)


def read_last_sync(path: Path, types: Collection[str]) -> StoredEvent | None:
    """The last event of one of ``types``, or None if the log has none; read-only like
    :func:`read_events_sync`, but reads only that row (and the calls its tokens refer to)."""
    sql = f"SELECT {COLUMNS} FROM events WHERE type IN ({', '.join('?' * len(types))})"
    found = select_sync(path, sql + " ORDER BY position DESC LIMIT 1", tuple(types))
    return found[-1] if found else None


def read_calls_sync(path: Path, rollout: str) -> list[LLMCallCompleted]:
    """The recorded calls of ``rollout``, in order; read-only like :func:`read_events_sync`, but
    reads only that rollout's call rows (through the rollout index)."""
    sql = f"SELECT {COLUMNS} FROM events WHERE rollout = ? AND type = ? ORDER BY position"
    found = select_sync(path, sql, (rollout, LLMCallCompleted.type))
    return [stored.event for stored in found if isinstance(stored.event, LLMCallCompleted)]


async def _tail(conn: aiosqlite.Connection) -> ChainReport:
    """The last position and its checksum, unverified (b"" without one: schema 1, or empty)."""
    rows = list(await conn.execute_fetchall(TAIL))
    if not rows:
        return ChainReport(0, b"")
    position, chain = rows[0]
    return ChainReport(position, b"" if chain is None else bytes(chain))


def _tokens(event: Event) -> int:
    """The tokens a kept event holds (a call's prompt), for the memory bound of recent commits."""
    return len(event.prompt_ids) if isinstance(event, LLMCallCompleted) else 0
