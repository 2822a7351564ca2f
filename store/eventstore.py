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
  caller in it gets :class:`StoreError` and nothing of the batch is in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite

from appliance.errors import StoreError
from store.codec import EncodedEvent, StoredEvent, decode, encode
from store.events import Event

__all__ = ["MAX_BATCH_EVENTS", "SCHEMA_VERSION", "EventStore", "StoredEvent", "read_events_sync"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: Most events committed in one transaction (a single larger ``append`` still goes in one piece).
MAX_BATCH_EVENTS = 1024
#: Events fetched per query by ``subscribe``.
_PAGE = 512
#: A read-only store sees other processes' commits only by looking again, this often (seconds).
_READONLY_POLL_S = 0.5

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE IF NOT EXISTS events (position INTEGER PRIMARY KEY, type TEXT NOT NULL,"
    " version INTEGER NOT NULL, rollout TEXT, ts REAL NOT NULL, data TEXT NOT NULL, blob BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS events_rollout ON events (rollout)",
    f"INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', '{SCHEMA_VERSION}')",
)
_COLUMNS = "position, type, version, rollout, ts, data, blob"
_INSERT = f"INSERT INTO events ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
_HEAD = "SELECT COALESCE(MAX(position), 0) FROM events"
_HAS_META = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
_GET_VERSION = "SELECT value FROM meta WHERE key = 'schema_version'"
_BUSY_TIMEOUT = "PRAGMA busy_timeout = 5000"


@dataclass(slots=True)
class _Pending:
    """One ``append`` call waiting for the writer."""

    rows: list[EncodedEvent]
    future: asyncio.Future[list[int]]


class EventStore:
    """Append-only event log over SQLite. Build it with ``await EventStore.open(path)``."""

    def __init__(
        self, path: Path, writer: aiosqlite.Connection | None, reader: aiosqlite.Connection, head: int
    ) -> None:
        self.path = path
        self.readonly = writer is None
        #: Transactions committed by this instance (one per group commit).
        self.commits = 0
        self._writer = writer
        self._reader = reader
        self._head = head
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._committed = asyncio.Condition()
        self._accepting = writer is not None
        self._closed = False
        self._close_task: asyncio.Future[None] | None = None
        self._writer_task = asyncio.create_task(self._write_loop()) if writer is not None else None

    @classmethod
    async def open(cls, path: Path, *, readonly: bool = False) -> EventStore:
        """Open (creating it unless ``readonly``) the store at ``path``."""
        if readonly and not await asyncio.to_thread(Path(path).is_file):
            raise StoreError(f"cannot open event store {path} read-only: no such file")
        async with contextlib.AsyncExitStack() as stack:
            try:
                writer = None
                if not readonly:
                    writer = await aiosqlite.connect(path, isolation_level=None)
                    stack.push_async_callback(writer.close)
                    await _prepare_writer(writer, path)
                reader = await aiosqlite.connect(_readonly_uri(path), uri=True, isolation_level=None)
                stack.push_async_callback(reader.close)
                await reader.execute(_BUSY_TIMEOUT)
                has_meta = bool(await reader.execute_fetchall(_HAS_META))
                _check_version(path, list(await reader.execute_fetchall(_GET_VERSION)) if has_meta else [])
                head = (await _fetchone(reader, _HEAD))[0]
            except sqlite3.Error as exc:
                raise StoreError(f"cannot open event store {path}: {exc}") from exc
            stack.pop_all()
        return cls(path, writer, reader, head)

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
        pending = _Pending([encode(e) for e in events], asyncio.get_running_loop().create_future())
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
            rows = await self._reader.execute_fetchall(sql, params)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read event store {self.path}: {exc}") from exc
        stored = [_stored(row) for row in rows]
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
            if self._writer is not None:
                await self._writer.close()
            await self._reader.close()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot close event store {self.path}: {exc}") from exc

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
        rows: list[tuple[Any, ...]] = []
        positions: list[list[int]] = []
        for pending in batch:
            ids = list(range(position + 1, position + 1 + len(pending.rows)))
            rows += [
                (i, r.type, r.version, r.rollout, r.ts, r.data, r.blob)
                for i, r in zip(ids, pending.rows, strict=True)
            ]
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
                    error = StoreError(f"could not commit {len(rows)} events to {self.path}: {exc!r}")
                    error.__cause__ = exc
                    pending.future.set_exception(exc if isinstance(exc, StoreError) else error)
            if not isinstance(exc, Exception):
                raise  # cancelled: the callers were told, let the task end
            return
        self._head = position
        self.commits += 1
        for pending, ids in zip(batch, positions, strict=True):
            if not pending.future.done():
                pending.future.set_result(ids)
        async with self._committed:
            self._committed.notify_all()


def read_events_sync(path: Path, *, after: int = 0) -> list[StoredEvent]:
    """Read the whole log (from ``after``) with stdlib sqlite3, read-only.

    Safe while another process appends (WAL readers see the last committed state).
    """
    try:
        with contextlib.closing(sqlite3.connect(_readonly_uri(path), uri=True)) as conn:
            conn.execute(_BUSY_TIMEOUT)
            has_meta = bool(conn.execute(_HAS_META).fetchall())
            _check_version(path, conn.execute(_GET_VERSION).fetchall() if has_meta else [])
            sql = f"SELECT {_COLUMNS} FROM events WHERE position > ? ORDER BY position"
            rows = conn.execute(sql, (after,)).fetchall()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read event store {path}: {exc}") from exc
    return [_stored(row) for row in rows]


async def _prepare_writer(conn: aiosqlite.Connection, path: Path) -> None:
    """Switch to WAL with full fsync and create the schema, or refuse a newer one."""
    (mode,) = await _fetchone(conn, "PRAGMA journal_mode = WAL")
    if str(mode).lower() != "wal":
        raise StoreError(f"event store {path} cannot use WAL mode (journal mode is {mode!r})")
    await conn.execute("PRAGMA synchronous = FULL")
    await conn.execute(_BUSY_TIMEOUT)
    await conn.execute("BEGIN IMMEDIATE")
    try:
        if await conn.execute_fetchall(_HAS_META):
            _check_version(path, list(await conn.execute_fetchall(_GET_VERSION)))
        for statement in _SCHEMA:
            await conn.execute(statement)
        await conn.execute("COMMIT")
    except BaseException:
        await conn.execute("ROLLBACK")
        raise


def _check_version(path: Path, rows: list[Any]) -> None:
    """``rows`` is the result of ``_GET_VERSION`` (empty when there is no meta table)."""
    if not rows:
        raise StoreError(f"{path} is not an event store (it has no meta table with a schema_version)")
    version = int(rows[0][0])
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"event store {path} has schema version {version}, newer than this appliance supports"
            f" ({SCHEMA_VERSION}); upgrade the appliance to open it"
        )


async def _fetchone(conn: aiosqlite.Connection, sql: str) -> Any:
    rows = list(await conn.execute_fetchall(sql))
    return rows[0]


def _stored(row: Any) -> StoredEvent:
    position, type_name, version, _rollout, ts, data, blob = row
    return StoredEvent(position, decode(type_name, version, ts, data, bytes(blob)))


def _readonly_uri(path: Path) -> str:
    return f"{Path(path).resolve().as_uri()}?mode=ro"
