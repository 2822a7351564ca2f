"""The event store: an append-only log of events in one SQLite file.

Owns the SQL schema, opening (creating, migrating, verifying) a store, and the reader connection
that serves ``read`` and ``subscribe``. It does not own the writer thread and its transactions
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
  store is copied with ``appliance.backup``).
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
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiosqlite

from appliance.errors import StoreCorrupted, StoreError
from store.codec import EncodedEvent, StoredEvent, as_stored, chain_digest, decode, prefix_source, shared_ref
from store.events import Event, JsonObject, LLMCallCompleted, TokenIds
from store.writer import COMMIT_BUCKETS_S, MAX_BATCH_EVENTS, Committed, Pending, Writer, store_error

__all__ = [
    "MAX_BATCH_EVENTS",
    "SCHEMA_VERSION",
    "ChainReport",
    "EventStore",
    "StoredEvent",
    "iter_events_sync",
    "read_calls_sync",
    "read_events_sync",
    "read_last_sync",
    "verify_log",
]

SCHEMA_VERSION = 3
#: The first schema version whose rows carry checksums.
_CHAINED_VERSION = 2
#: The first schema version whose calls may share their request with an earlier call (older
#: appliances cannot read those rows, so they must refuse the store).
_SHARED_REQUEST_VERSION = 3
#: Events fetched per query by ``subscribe``.
_PAGE = 512
#: A read-only store sees other processes' commits only by looking again, this often (seconds).
_READONLY_POLL_S = 0.5
#: Tokens (of recent calls) a reader keeps to rebuild later calls' shared prefixes: ~8 bytes each
#: (their requests are kept along, the messages shared with the next call's).
_DECODED_TOKENS = 4_000_000
#: The latest commits a writer keeps in memory for its subscribers, so that one keeping up gets
#: each new event without reading and decoding it again: at most this many events and this many
#: tokens of calls' prompts (a subscriber further behind reads the log).
_RECENT_EVENTS = 1024
_RECENT_TOKENS = 1_000_000
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
_CALLS_BETWEEN = (
    f"SELECT {_COLUMNS} FROM events WHERE rollout = ? AND type = ? AND position >= ? AND position < ?"
    " ORDER BY position"
)
_CHAINED = f"SELECT {_COLUMNS}, chain FROM events WHERE position > ? ORDER BY position LIMIT ?"
_TAIL = "SELECT position, chain FROM events ORDER BY position DESC LIMIT 1"
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
        self._decoder = _Decoder()
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
                    writer = await asyncio.to_thread(_connect_writer, path, max_bytes)
                    stack.callback(writer.close)
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
            await self._writer.call(lambda conn: _cap_size(conn, max_bytes))
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
            _check_progress(self.path, need, last_need)
            last_need = need
            merged = _merge(merged, await self._reader.execute_fetchall(_CALLS_BETWEEN, need))
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


class _Decoder:
    """Rows -> events, rebuilding shared prefixes and requests from earlier calls (an LRU cache)."""

    def __init__(self) -> None:
        self._sources: OrderedDict[int, tuple[TokenIds, JsonObject]] = OrderedDict()
        self._tokens = 0  # held in ``_sources``

    def missing(self, rows: Sequence[Row]) -> tuple[str, str, int, int] | None:
        """(rollout, type, from, to) of the earlier calls to fetch for ``rows``, or None."""
        seen: set[int] = set()
        for position, type_name, _version, rollout, _ts, data, blob in rows:
            ref = shared_ref(type_name, data, bytes(blob))
            if ref is not None and ref not in seen and ref not in self._sources:
                return (rollout, type_name, ref, position)
            seen.add(position)
        return None

    def _remember(self, position: int, source: tuple[TokenIds, JsonObject]) -> None:
        old = self._sources.pop(position, None)
        self._tokens += len(source[0]) - (0 if old is None else len(old[0]))
        self._sources[position] = source
        while self._tokens > _DECODED_TOKENS and len(self._sources) > 1:
            self._tokens -= len(self._sources.popitem(last=False)[1][0])

    def decode(self, rows: Sequence[Row]) -> list[StoredEvent]:
        """Decode ``rows`` (in position order, each reference among them or in the cache)."""
        local: dict[int, tuple[TokenIds, JsonObject]] = {}
        refs = [shared_ref(row[1], row[5], bytes(row[6])) for row in rows]
        for ref in refs:  # take from the cache before decoding adds to (and evicts from) it
            if ref is not None and ref in self._sources:
                local[ref] = self._sources[ref]
                self._sources.move_to_end(ref)
        out: list[StoredEvent] = []
        for (position, type_name, version, _rollout, ts, data, blob), ref in zip(rows, refs, strict=True):
            earlier = None if ref is None else local.get(ref)
            tokens, request = (None, None) if earlier is None else earlier
            event = decode(type_name, version, ts, data, bytes(blob), tokens, request)
            source = prefix_source(event)
            if source is not None:
                assert isinstance(event, LLMCallCompleted)
                local[position] = (source, event.request)
                self._remember(position, local[position])
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


def read_events_sync(path: Path, *, after: int = 0, limit: int | None = None) -> list[StoredEvent]:
    """Read the log (from ``after``, at most ``limit`` events) with stdlib sqlite3, read-only.

    Safe while another process appends (WAL readers see the last committed state).
    """
    return _read_sync(path, after, limit, _Decoder())


def iter_events_sync(path: Path, *, after: int = 0, page: int = _PAGE) -> Iterator[StoredEvent]:
    """Every event after ``after``, in order, read ``page`` events at a time: a fold of a long
    log holds one page of events at once, not the whole log (read-only like
    :func:`read_events_sync`; the shared prompts of one page are remembered for the next)."""
    decoder = _Decoder()
    while True:
        found = _read_sync(path, after, page, decoder)
        yield from found
        if len(found) < page:
            return
        after = found[-1].position


def _read_sync(path: Path, after: int, limit: int | None, decoder: _Decoder) -> list[StoredEvent]:
    sql = f"SELECT {_COLUMNS} FROM events WHERE position > ? ORDER BY position"
    if limit is None:
        return _select_sync(path, sql, (after,), decoder)
    return _select_sync(path, sql + " LIMIT ?", (after, limit), decoder)


def read_last_sync(path: Path, types: Collection[str]) -> StoredEvent | None:
    """The last event of one of ``types``, or None if the log has none; read-only like
    :func:`read_events_sync`, but reads only that row (and the calls its tokens refer to)."""
    sql = f"SELECT {_COLUMNS} FROM events WHERE type IN ({', '.join('?' * len(types))})"
    found = _select_sync(path, sql + " ORDER BY position DESC LIMIT 1", tuple(types))
    return found[-1] if found else None


def read_calls_sync(path: Path, rollout: str) -> list[LLMCallCompleted]:
    """The recorded calls of ``rollout``, in order; read-only like :func:`read_events_sync`, but
    reads only that rollout's call rows (through the rollout index)."""
    sql = f"SELECT {_COLUMNS} FROM events WHERE rollout = ? AND type = ? ORDER BY position"
    found = _select_sync(path, sql, (rollout, LLMCallCompleted.type))
    return [stored.event for stored in found if isinstance(stored.event, LLMCallCompleted)]


def _select_sync(
    path: Path, sql: str, params: tuple[Any, ...], decoder: _Decoder | None = None
) -> list[StoredEvent]:
    """The events of the rows ``sql`` selects (``_COLUMNS``, in position order), decoded (with
    ``decoder``'s remembered prompts, when one is given)."""
    if decoder is None:
        decoder = _Decoder()
    try:
        with contextlib.closing(sqlite3.connect(_readonly_uri(path), uri=True)) as conn:
            conn.execute(_BUSY_TIMEOUT)
            has_meta = bool(conn.execute(_HAS_META).fetchall())
            _check_version(path, conn.execute(_GET_VERSION).fetchall() if has_meta else [])
            selected = conn.execute(sql, params).fetchall()
            wanted = {row[0] for row in selected}
            merged, last_need = selected, None
            while (need := decoder.missing(merged)) is not None:
                _check_progress(path, need, last_need)
                last_need = need
                merged = _merge(merged, conn.execute(_CALLS_BETWEEN, need).fetchall())
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read event store {path}: {exc}") from exc
    return [s for s in decoder.decode(merged) if s.position in wanted]


def _connect_writer(path: Path, max_bytes: int | None) -> sqlite3.Connection:
    """The writer connection, prepared (see ``_prepare_writer``) and capped at ``max_bytes``.

    Used by the writer thread only once the store is open (it is made in another thread).
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        _prepare_writer(conn, path)
        if max_bytes is not None:
            _cap_size(conn, max_bytes)
    except BaseException:
        conn.close()
        raise
    return conn


def _prepare_writer(conn: sqlite3.Connection, path: Path) -> None:
    """Switch to WAL with full fsync and create the schema, migrate an older one, or refuse a newer one."""
    (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
    if str(mode).lower() != "wal":
        raise StoreError(f"event store {path} cannot use WAL mode (journal mode is {mode!r})")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(_BUSY_TIMEOUT)
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = SCHEMA_VERSION
        if conn.execute(_HAS_META).fetchall():
            version = _check_version(path, conn.execute(_GET_VERSION).fetchall())
        if version < _CHAINED_VERSION:
            _add_checksums(conn)
        for statement in _SCHEMA:
            conn.execute(statement)
        if version < _SHARED_REQUEST_VERSION:  # nothing to change in the rows: they stay readable
            conn.execute(f"UPDATE meta SET value = '{SCHEMA_VERSION}' WHERE key = 'schema_version'")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _cap_size(conn: sqlite3.Connection, max_bytes: int | None) -> None:
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    pages = _NO_CAP_PAGES if max_bytes is None else max(1, max_bytes // page_size)
    conn.execute(f"PRAGMA max_page_count = {pages}")


def _add_checksums(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2 (inside the caller's transaction): give every existing row its checksum."""
    conn.execute("ALTER TABLE events ADD COLUMN chain BLOB")
    digest, after = b"", 0
    while rows := conn.execute(_CHAINED, (after, _PAGE * 8)).fetchall():
        updates = []
        for position, type_name, version, rollout, ts, data, blob, _chain in rows:
            digest = chain_digest(digest, position, EncodedEvent(type_name, version, rollout, ts, data, blob))
            updates.append((digest, position))
        conn.executemany("UPDATE events SET chain = ? WHERE position = ?", updates)
        after = rows[-1][0]
    conn.execute(f"UPDATE meta SET value = '{_CHAINED_VERSION}' WHERE key = 'schema_version'")


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
            f"event store {path} is corrupted: the event at {need[3]} shares tokens with a call"
            f" at {need[2]} that is not in the log"
        )


def _tokens(event: Event) -> int:
    """The tokens a kept event holds (a call's prompt), for the memory bound of recent commits."""
    return len(event.prompt_ids) if isinstance(event, LLMCallCompleted) else 0


def _readonly_uri(path: Path) -> str:
    return f"{Path(path).resolve().as_uri()}?mode=ro"
