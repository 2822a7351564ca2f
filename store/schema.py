"""The SQLite file of the event store: its schema, its versions and their migrations.

Owns the ``meta`` and ``events`` tables and the SQL that reads them, the schema version a file
carries (a newer one than this appliance knows is refused), and the writer connection: WAL with
full fsync, the schema created or migrated (a schema 1 file gets its checksums), its size cap.
It does not own what is done through the connections (``store.eventstore``, ``store.writer``)
nor what a row holds (``store.codec``).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from contracts.errors import StoreError
from store.codec import EncodedEvent, chain_digest

SCHEMA_VERSION = 3
#: The first schema version whose rows carry checksums.
CHAINED_VERSION = 2
#: The first schema version whose calls may share their request with an earlier call (older
#: appliances cannot read those rows, so they must refuse the store).
_SHARED_REQUEST_VERSION = 3
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
COLUMNS = "position, type, version, rollout, ts, data, blob"
CALLS_BETWEEN = (
    f"SELECT {COLUMNS} FROM events WHERE rollout = ? AND type = ? AND position >= ? AND position < ?"
    " ORDER BY position"
)
CHAINED = f"SELECT {COLUMNS}, chain FROM events WHERE position > ? ORDER BY position LIMIT ?"
TAIL = "SELECT position, chain FROM events ORDER BY position DESC LIMIT 1"
HAS_META = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
GET_VERSION = "SELECT value FROM meta WHERE key = 'schema_version'"
BUSY_TIMEOUT = "PRAGMA busy_timeout = 5000"
#: Rows read per query when a whole chain is walked (verified, or added to a schema 1 file).
CHAIN_PAGE = 4096
#: A row as selected with ``COLUMNS`` (a tuple from sqlite3, an ``sqlite3.Row`` from aiosqlite).
Row = Any


def connect_writer(path: Path, max_bytes: int | None) -> sqlite3.Connection:
    """The writer connection, prepared (see ``_prepare_writer``) and capped at ``max_bytes``.

    Used by the writer thread only once the store is open (it is made in another thread).
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        _prepare_writer(conn, path)
        if max_bytes is not None:
            cap_size(conn, max_bytes)
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
    conn.execute(BUSY_TIMEOUT)
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = SCHEMA_VERSION
        if conn.execute(HAS_META).fetchall():
            version = check_version(path, conn.execute(GET_VERSION).fetchall())
        if version < CHAINED_VERSION:
            _add_checksums(conn)
        for statement in _SCHEMA:
            conn.execute(statement)
        if version < _SHARED_REQUEST_VERSION:  # nothing to change in the rows: they stay readable
            conn.execute(f"UPDATE meta SET value = '{SCHEMA_VERSION}' WHERE key = 'schema_version'")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def cap_size(conn: sqlite3.Connection, max_bytes: int | None) -> None:
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    pages = _NO_CAP_PAGES if max_bytes is None else max(1, max_bytes // page_size)
    conn.execute(f"PRAGMA max_page_count = {pages}")


def _add_checksums(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2 (inside the caller's transaction): give every existing row its checksum."""
    conn.execute("ALTER TABLE events ADD COLUMN chain BLOB")
    digest, after = b"", 0
    while rows := conn.execute(CHAINED, (after, CHAIN_PAGE)).fetchall():
        updates = []
        for position, type_name, version, rollout, ts, data, blob, _chain in rows:
            digest = chain_digest(digest, position, EncodedEvent(type_name, version, rollout, ts, data, blob))
            updates.append((digest, position))
        conn.executemany("UPDATE events SET chain = ? WHERE position = ?", updates)
        after = rows[-1][0]
    conn.execute(f"UPDATE meta SET value = '{CHAINED_VERSION}' WHERE key = 'schema_version'")


def check_version(path: Path, rows: list[Any]) -> int:
    """The schema version; ``rows`` is the result of ``GET_VERSION`` (empty without a meta table)."""
    if not rows:
        raise StoreError(f"{path} is not an event store (it has no meta table with a schema_version)")
    version = int(rows[0][0])
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"event store {path} has schema version {version}, newer than this appliance supports"
            f" ({SCHEMA_VERSION}); upgrade the appliance to open it"
        )
    return version


def connect_readonly(path: Path) -> tuple[sqlite3.Connection, int]:
    """A read-only stdlib connection to the store at ``path``, and its schema version (checked:
    StoreError for a file that is no store, or a newer one)."""
    conn = sqlite3.connect(readonly_uri(path), uri=True)
    try:
        conn.execute(BUSY_TIMEOUT)
        has_meta = bool(conn.execute(HAS_META).fetchall())
        version = check_version(path, conn.execute(GET_VERSION).fetchall() if has_meta else [])
    except BaseException:
        conn.close()
        raise
    return conn, version


def readonly_uri(path: Path) -> str:
    return f"{Path(path).resolve().as_uri()}?mode=ro"
