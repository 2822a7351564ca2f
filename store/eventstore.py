"""The event store: an append-only log of events in one SQLite file.

Owns the SQL schema, the single writer (one connection, one task, group commit) and the reader
connection that serves ``read`` and ``subscribe``. It does not own how an event becomes a row
(``store.codec``) nor what the events mean (``store.projections``).

Invariants:

* Positions are 1, 2, 3, ... without gaps, in commit order. Only this process writes: the writer
  keeps the next position in memory and checks, inside each transaction, that nobody else
  moved the end of the log.
* ``append`` returns only after the transaction holding its events is durable (WAL with
  ``synchronous=FULL``): an acknowledged event survives a crash or power loss. The events of one
  ``append`` call are committed together or not at all.
* Appends that queue up while a commit is in flight are committed together in the next
  transaction (group commit): one fsync serves many callers. If that transaction fails, every
  caller in it gets :class:`StoreError` (:class:`StoreFull` when the disk is full) and nothing
  of the batch is in the log.
* Every row carries ``chain``, the checksum of its columns chained over the previous row's
  (``store.codec.chain_digest``). Opening a store for writing verifies the whole chain
  (:func:`verify_log`) and refuses a log that was changed, truncated inside, or has a gap
  (:class:`StoreCorrupted`). Schema version 1 stores (no checksums) get them on that open.
* A clean ``close`` of the writer checkpoints the WAL (``wal_checkpoint(TRUNCATE)``): the main
  file alone then holds every event, so copying ``events.sqlite`` copies the run's log (a live
  store is copied with ``appliance.backup``).
* A call's prompt that starts with the previous call of its rollout is stored as a reference to
  that call plus the new suffix (``store.codec.share_prefix``); reads rebuild it, so the events
  read back are the events appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite

from appliance.errors import StoreCorrupted, StoreError, StoreFull
from store.codec import (
    EncodedEvent,
    StoredEvent,
    chain_digest,
    decode,
    encode,
    prefix_source,
    share_prefix,
    shared_prefix_ref,
)
from store.events import Event, LLMCallCompleted, RolloutFinished, TokenIds

__all__ = [
    "MAX_BATCH_EVENTS",
    "SCHEMA_VERSION",
    "ChainReport",
    "EventStore",
    "StoredEvent",
    "read_events_sync",
    "read_last_sync",
    "verify_log",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
#: The first schema version whose rows carry checksums.
_CHAINED_VERSION = 2
#: Most events committed in one transaction (a single larger ``append`` still goes in one piece).
MAX_BATCH_EVENTS = 1024
#: Events fetched per query by ``subscribe``.
_PAGE = 512
#: A read-only store sees other processes' commits only by looking again, this often (seconds).
_READONLY_POLL_S = 0.5
#: Rollouts whose last call the writer remembers for prefix sharing (running ones; LRU beyond).
_SHARING_ROLLOUTS = 4096
#: Tokens (of recent calls) a reader keeps to rebuild later calls' shared prefixes: ~8 bytes each.
_DECODED_TOKENS = 4_000_000
#: A clean close checkpoints the WAL into the main file: tries, each waiting this long for
#: readers (milliseconds), with this pause between them (seconds).
_CHECKPOINT_TRIES = 5
_CHECKPOINT_BUSY_MS = 200
_CHECKPOINT_PAUSE_S = 0.1
#: ``max_page_count`` meaning "no cap" (SQLite clamps it to its own largest).
_NO_CAP_PAGES = 0xFFFF_FFFE

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE IF NOT EXISTS events (position INTEGER PRIMARY KEY, type TEXT NOT NULL,"
    " version INTEGER NOT NULL, rollout TEXT, ts REAL NOT NULL, data TEXT NOT NULL, blob BLOB NOT NULL,"
    " chain BLOB)",
    "CREATE INDEX IF NOT EXISTS events_rollout ON events (rollout)",
    f"INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', '{SCHEMA_VERSION}')",
)
_COLUMNS = "position, type, version, rollout, ts, data, blob"
_INSERT = f"INSERT INTO events ({_COLUMNS}, chain) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_CALLS_BETWEEN = (
    f"SELECT {_COLUMNS} FROM events WHERE rollout = ? AND type = ? AND position >= ? AND position < ?"
    " ORDER BY position"
)
_CHAINED = f"SELECT {_COLUMNS}, chain FROM events WHERE position > ? ORDER BY position LIMIT ?"
_TAIL = "SELECT position, chain FROM events ORDER BY position DESC LIMIT 1"
_HEAD = "SELECT COALESCE(MAX(position), 0) FROM events"
_HAS_META = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
_GET_VERSION = "SELECT value FROM meta WHERE key = 'schema_version'"
_BUSY_TIMEOUT = "PRAGMA busy_timeout = 5000"
#: A row as selected with ``_COLUMNS`` (a tuple from sqlite3, an ``sqlite3.Row`` from aiosqlite).
Row = Any


@dataclass(frozen=True, slots=True)
class ChainReport:
    """What :func:`verify_log` checked: every row's checksum, chained, positions 1..``events``."""

    events: int
    #: The last row's checksum (b"" for an empty log): the next row chains over it.
    digest: bytes


@dataclass(slots=True)
class _Pending:
    """One ``append`` call waiting for the writer."""

    events: Sequence[Event]
    rows: list[EncodedEvent]
    future: asyncio.Future[list[int]]


class EventStore:
    """Append-only event log over SQLite. Build it with ``await EventStore.open(path)``."""

    def __init__(
        self,
        path: Path,
        writer: aiosqlite.Connection | None,
        reader: aiosqlite.Connection,
        tail: ChainReport,
        *,
        share_prefixes: bool = True,
    ) -> None:
        self.path = path
        self.readonly = writer is None
        #: Transactions committed by this instance (one per group commit).
        self.commits = 0
        self._writer = writer
        self._reader = reader
        self._head = tail.events
        self._digest = tail.digest
        self._share_prefixes = share_prefixes
        #: rollout -> (position, prompt + response) of its last call, for prefix sharing.
        self._last_call: OrderedDict[str, tuple[int, TokenIds]] = OrderedDict()
        self._decoder = _Decoder()
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._committed = asyncio.Condition()
        self._accepting = writer is not None
        self._closed = False
        self._close_task: asyncio.Future[None] | None = None
        self._writer_task = asyncio.create_task(self._write_loop()) if writer is not None else None

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
        call's tokens whole. ``max_bytes`` caps the database file: appends that would grow it
        further fail with :class:`StoreFull`, as on a full disk.
        """
        if readonly and not await asyncio.to_thread(Path(path).is_file):
            raise StoreError(f"cannot open event store {path} read-only: no such file")
        async with contextlib.AsyncExitStack() as stack:
            try:
                writer = None
                if not readonly:
                    writer = await aiosqlite.connect(path, isolation_level=None)
                    stack.push_async_callback(writer.close)
                    await _prepare_writer(writer, path)
                    if max_bytes is not None:
                        await _cap_size(writer, max_bytes)
                reader = await aiosqlite.connect(_readonly_uri(path), uri=True, isolation_level=None)
                stack.push_async_callback(reader.close)
                await reader.execute(_BUSY_TIMEOUT)
                has_meta = bool(await reader.execute_fetchall(_HAS_META))
                _check_version(path, list(await reader.execute_fetchall(_GET_VERSION)) if has_meta else [])
                if writer is not None and verify:
                    tail = await asyncio.to_thread(verify_log, path)
                else:
                    tail = await _tail(reader)
            except sqlite3.Error as exc:
                raise _store_error(f"cannot open event store {path}", exc) from exc
            stack.pop_all()
        return cls(path, writer, reader, tail, share_prefixes=share_prefixes)

    async def set_max_bytes(self, max_bytes: int | None) -> None:
        """Cap the database file at about ``max_bytes`` (None: no cap); see ``open``.

        A cap below the current size holds the store at its current size.
        """
        if self._writer is None or not self._accepting:
            raise StoreError(f"event store {self.path} is not open for writing: cannot cap its size")
        try:
            await _cap_size(self._writer, max_bytes)
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
        rows = [encode(e) for e in events]
        pending = _Pending(events, rows, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(pending)
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
        sql = f"SELECT {_COLUMNS} FROM events WHERE position > ?"
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
            _check_progress(self.path, need, last_need)
            last_need = need
            merged = _merge(merged, await self._reader.execute_fetchall(_CALLS_BETWEEN, need))
        return [s for s in self._decoder.decode(merged) if s.position in wanted]

    async def _close(self) -> None:
        self._accepting = False
        if self._writer_task is not None:
            self._queue.put_nowait(None)
            try:
                await self._writer_task
            except Exception:
                log.exception("event store writer failed")
        self._closed = True
        async with self._committed:
            self._committed.notify_all()
        try:
            await self._reader.close()
            if self._writer is not None:
                await self._checkpoint()
                await self._writer.close()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot close event store {self.path}: {exc}") from exc

    async def _checkpoint(self) -> None:
        """Copy every committed page into the main file and empty the WAL, so that the main
        file alone holds the whole log (a user may copy just ``events.sqlite``).

        A reader in the middle of a read (``status``, the dashboard) holds the WAL: retry
        briefly, then leave it; the next writer's open or close checkpoints it.
        """
        assert self._writer is not None
        for _ in range(_CHECKPOINT_TRIES):
            try:
                await self._writer.execute(f"PRAGMA busy_timeout = {_CHECKPOINT_BUSY_MS}")
                (busy, _wal_pages, _copied) = await _fetchone(self._writer, "PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:  # e.g. a full disk: the WAL still holds every event
                log.warning("event store %s: could not checkpoint the WAL on close: %s", self.path, exc)
                return
            if not busy:
                return
            await asyncio.sleep(_CHECKPOINT_PAUSE_S)
        log.warning(
            "event store %s: readers kept its WAL busy at close; its -wal file still holds events", self.path
        )

    async def _wait_past(self, position: int) -> None:
        def ready() -> bool:
            return self._closed or self._head > position

        async with self._committed:
            if not self.readonly:
                await self._committed.wait_for(ready)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._committed.wait_for(ready), _READONLY_POLL_S)

    async def _write_loop(self) -> None:
        """Take everything queued (up to MAX_BATCH_EVENTS) and commit it in one transaction."""
        carry: _Pending | None = None
        try:
            while True:
                first = carry if carry is not None else await self._queue.get()
                carry = None
                if first is None:
                    return
                batch, size, stop = [first], len(first.rows), False
                while not self._queue.empty():
                    item = self._queue.get_nowait()
                    if item is None:
                        stop = True
                        break
                    if size + len(item.rows) > MAX_BATCH_EVENTS:
                        carry = item
                        break
                    batch.append(item)
                    size += len(item.rows)
                await self._commit(batch)
                if stop:
                    return
        finally:  # only reached with work left if the task is cancelled or crashes
            left: list[_Pending | None] = [carry]
            while not self._queue.empty():
                left.append(self._queue.get_nowait())
            for pending in left:
                if pending is not None and not pending.future.done():
                    pending.future.set_exception(StoreError(f"event store {self.path} writer stopped"))

    async def _commit(self, batch: list[_Pending]) -> None:
        assert self._writer is not None
        start = position = self._head
        digest = self._digest
        sharing: dict[str, tuple[int, TokenIds] | None] = {}  # changes to _last_call if it commits
        rows: list[tuple[Any, ...]] = []
        positions: list[list[int]] = []
        for pending in batch:
            ids = list(range(position + 1, position + 1 + len(pending.rows)))
            for i, event, row in zip(ids, pending.events, pending.rows, strict=True):
                if self._share_prefixes:
                    row = self._shared(i, event, row, sharing)
                digest = chain_digest(digest, i, row)
                rows.append((i, row.type, row.version, row.rollout, row.ts, row.data, row.blob, digest))
            positions.append(ids)
            position += len(ids)
        try:
            await self._writer.execute("BEGIN IMMEDIATE")
            try:
                head = (await _fetchone(self._writer, _HEAD))[0]
                if head != start:
                    raise StoreError(
                        f"another process wrote to event store {self.path} (log ends at {head},"
                        f" this writer expected {start}); only one appliance may use a store"
                    )
                await self._writer.executemany(_INSERT, rows)
                await self._writer.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error, ValueError):  # COMMIT may have rolled back
                    await self._writer.execute("ROLLBACK")
                raise
        except BaseException as exc:
            for pending in batch:  # the counter stays at ``start``: nothing of the batch exists
                if not pending.future.done():
                    error = _store_error(f"could not commit {len(rows)} events to {self.path}", exc)
                    error.__cause__ = exc
                    pending.future.set_exception(exc if isinstance(exc, StoreError) else error)
            if not isinstance(exc, Exception):
                raise  # cancelled: the callers were told, let the task end
            return
        self._head = position
        self._digest = digest
        self.commits += 1
        for rollout, last in sharing.items():
            self._last_call.pop(rollout, None)
            if last is not None:
                self._last_call[rollout] = last
        while len(self._last_call) > _SHARING_ROLLOUTS:
            self._last_call.popitem(last=False)
        for pending, ids in zip(batch, positions, strict=True):
            if not pending.future.done():
                pending.future.set_result(ids)
        async with self._committed:
            self._committed.notify_all()

    def _shared(
        self, position: int, event: Event, row: EncodedEvent, sharing: dict[str, tuple[int, TokenIds] | None]
    ) -> EncodedEvent:
        """``row`` with its prompt shared with the rollout's previous call; note this call."""
        rollout = row.rollout
        if rollout is None:
            return row
        if isinstance(event, LLMCallCompleted):
            earlier = sharing[rollout] if rollout in sharing else self._last_call.get(rollout)
            if earlier is not None:
                row = share_prefix(row, event, *earlier)
            source = prefix_source(event)
            sharing[rollout] = None if source is None else (position, source)
        elif isinstance(event, RolloutFinished):
            sharing[rollout] = None
        return row


class _Decoder:
    """Rows -> events, rebuilding shared prefixes from earlier calls (kept in an LRU cache)."""

    def __init__(self) -> None:
        self._sources: OrderedDict[int, TokenIds] = OrderedDict()
        self._tokens = 0  # held in ``_sources``

    def missing(self, rows: Sequence[Row]) -> tuple[str, str, int, int] | None:
        """(rollout, type, from, to) of the earlier calls to fetch for ``rows``, or None."""
        seen: set[int] = set()
        for position, type_name, _version, rollout, _ts, _data, blob in rows:
            ref = shared_prefix_ref(type_name, bytes(blob))
            if ref is not None and ref not in seen and ref not in self._sources:
                return (rollout, type_name, ref, position)
            seen.add(position)
        return None

    def _remember(self, position: int, source: TokenIds) -> None:
        old = self._sources.pop(position, None)
        self._tokens += len(source) - (0 if old is None else len(old))
        self._sources[position] = source
        while self._tokens > _DECODED_TOKENS and len(self._sources) > 1:
            self._tokens -= len(self._sources.popitem(last=False)[1])

    def decode(self, rows: Sequence[Row]) -> list[StoredEvent]:
        """Decode ``rows`` (in position order, each reference among them or in the cache)."""
        local: dict[int, TokenIds] = {}
        for row in rows:  # take from the cache before decoding adds to (and evicts from) it
            ref = shared_prefix_ref(row[1], bytes(row[6]))
            if ref is not None and ref in self._sources:
                local[ref] = self._sources[ref]
                self._sources.move_to_end(ref)
        out: list[StoredEvent] = []
        for position, type_name, version, _rollout, ts, data, blob in rows:
            blob = bytes(blob)
            ref = shared_prefix_ref(type_name, blob)
            event = decode(type_name, version, ts, data, blob, None if ref is None else local.get(ref))
            source = prefix_source(event)
            if source is not None:
                local[position] = source
                self._remember(position, source)
            out.append(StoredEvent(position, event))
        return out


def verify_log(path: Path) -> ChainReport:
    """Check every row's checksum and that positions run 1..N; raise StoreCorrupted if not.

    Reads with stdlib sqlite3, read-only, page by page; safe while another process appends.
    """
    digest, expected = b"", 1
    try:
        with contextlib.closing(sqlite3.connect(_readonly_uri(path), uri=True)) as conn:
            conn.execute(_BUSY_TIMEOUT)
            has_meta = bool(conn.execute(_HAS_META).fetchall())
            version = _check_version(path, conn.execute(_GET_VERSION).fetchall() if has_meta else [])
            if version < _CHAINED_VERSION:
                raise StoreError(
                    f"event store {path} has no checksums yet (schema version {version}):"
                    " open it for writing once to add them"
                )
            conn.execute("BEGIN")  # one snapshot for all pages
            while rows := conn.execute(_CHAINED, (expected - 1, _PAGE * 8)).fetchall():
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


def read_events_sync(path: Path, *, after: int = 0) -> list[StoredEvent]:
    """Read the whole log (from ``after``) with stdlib sqlite3, read-only.

    Safe while another process appends (WAL readers see the last committed state).
    """
    return _select_sync(path, f"SELECT {_COLUMNS} FROM events WHERE position > ? ORDER BY position", (after,))


def read_last_sync(path: Path, types: Collection[str]) -> StoredEvent | None:
    """The last event of one of ``types``, or None if the log has none; read-only like
    :func:`read_events_sync`, but reads only that row (and the calls its tokens refer to)."""
    sql = f"SELECT {_COLUMNS} FROM events WHERE type IN ({', '.join('?' * len(types))})"
    found = _select_sync(path, sql + " ORDER BY position DESC LIMIT 1", tuple(types))
    return found[-1] if found else None


def _select_sync(path: Path, sql: str, params: tuple[Any, ...]) -> list[StoredEvent]:
    """The events of the rows ``sql`` selects (``_COLUMNS``, in position order), decoded."""
    try:
        with contextlib.closing(sqlite3.connect(_readonly_uri(path), uri=True)) as conn:
            conn.execute(_BUSY_TIMEOUT)
            has_meta = bool(conn.execute(_HAS_META).fetchall())
            _check_version(path, conn.execute(_GET_VERSION).fetchall() if has_meta else [])
            selected = conn.execute(sql, params).fetchall()
            wanted = {row[0] for row in selected}
            merged, decoder, last_need = selected, _Decoder(), None
            while (need := decoder.missing(merged)) is not None:
                _check_progress(path, need, last_need)
                last_need = need
                merged = _merge(merged, conn.execute(_CALLS_BETWEEN, need).fetchall())
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read event store {path}: {exc}") from exc
    return [s for s in decoder.decode(merged) if s.position in wanted]


async def _prepare_writer(conn: aiosqlite.Connection, path: Path) -> None:
    """Switch to WAL with full fsync and create the schema, migrate an older one, or refuse a newer one."""
    (mode,) = await _fetchone(conn, "PRAGMA journal_mode = WAL")
    if str(mode).lower() != "wal":
        raise StoreError(f"event store {path} cannot use WAL mode (journal mode is {mode!r})")
    await conn.execute("PRAGMA synchronous = FULL")
    await conn.execute(_BUSY_TIMEOUT)
    await conn.execute("BEGIN IMMEDIATE")
    try:
        version = SCHEMA_VERSION
        if await conn.execute_fetchall(_HAS_META):
            version = _check_version(path, list(await conn.execute_fetchall(_GET_VERSION)))
        if version < _CHAINED_VERSION:
            await _add_checksums(conn)
        for statement in _SCHEMA:
            await conn.execute(statement)
        await conn.execute("COMMIT")
    except BaseException:
        await conn.execute("ROLLBACK")
        raise


async def _cap_size(conn: aiosqlite.Connection, max_bytes: int | None) -> None:
    (page_size,) = await _fetchone(conn, "PRAGMA page_size")
    pages = _NO_CAP_PAGES if max_bytes is None else max(1, max_bytes // page_size)
    await conn.execute(f"PRAGMA max_page_count = {pages}")


async def _add_checksums(conn: aiosqlite.Connection) -> None:
    """Schema 1 -> 2 (inside the caller's transaction): give every existing row its checksum."""
    await conn.execute("ALTER TABLE events ADD COLUMN chain BLOB")
    digest, after = b"", 0
    while rows := list(await conn.execute_fetchall(_CHAINED, (after, _PAGE * 8))):
        updates = []
        for position, type_name, version, rollout, ts, data, blob, _chain in rows:
            digest = chain_digest(digest, position, EncodedEvent(type_name, version, rollout, ts, data, blob))
            updates.append((digest, position))
        await conn.executemany("UPDATE events SET chain = ? WHERE position = ?", updates)
        after = rows[-1][0]
    await conn.execute(f"UPDATE meta SET value = '{_CHAINED_VERSION}' WHERE key = 'schema_version'")


def _check_version(path: Path, rows: list[Any]) -> int:
    """The schema version; ``rows`` is the result of ``_GET_VERSION`` (empty without a meta table)."""
    if not rows:
        raise StoreError(f"{path} is not an event store (it has no meta table with a schema_version)")
    version = int(rows[0][0])
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"event store {path} has schema version {version}, newer than this appliance supports"
            f" ({SCHEMA_VERSION}); upgrade the appliance to open it"
        )
    return version


async def _fetchone(conn: aiosqlite.Connection, sql: str) -> Any:
    rows = list(await conn.execute_fetchall(sql))
    return rows[0]


async def _tail(conn: aiosqlite.Connection) -> ChainReport:
    """The last position and its checksum, unverified (b"" without one: schema 1, or empty)."""
    rows = list(await conn.execute_fetchall(_TAIL))
    if not rows:
        return ChainReport(0, b"")
    position, chain = rows[0]
    return ChainReport(position, b"" if chain is None else bytes(chain))


def _merge(rows: Iterable[Row], more: Iterable[Row]) -> list[Row]:
    """Both row lists as one, by position, without duplicates."""
    return sorted({row[0]: row for row in [*rows, *more]}.values(), key=lambda row: int(row[0]))


def _check_progress(
    path: Path, need: tuple[str, str, int, int], last: tuple[str, str, int, int] | None
) -> None:
    if need == last:
        raise StoreCorrupted(
            f"event store {path} is corrupted: the event at {need[3]} shares tokens with a call at"
            f" {need[2]} that is not in the log"
        )


def _store_error(message: str, exc: BaseException) -> StoreError:
    """``StoreFull`` for a full disk (or size cap), else ``StoreError``."""
    if isinstance(exc, sqlite3.Error) and (exc.sqlite_errorcode & 0xFF) == sqlite3.SQLITE_FULL:
        return StoreFull(
            f"{message}: the disk (or the store's size cap) is full; free space and retry ({exc})"
        )
    return StoreError(f"{message}: {exc!r}")


def _readonly_uri(path: Path) -> str:
    return f"{Path(path).resolve().as_uri()}?mode=ro"
