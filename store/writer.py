"""The single writer of an event store: one thread, one sqlite3 connection, group commit.

Owns the writer connection once the store is open, the position and checksum of the end of the
log, and the rollouts' last calls that later calls share prefixes and requests with. It does not
own the schema (``store.schema``), the reads (``store.eventstore``) nor how an event becomes a
row (``store.codec``).

The store hands over the appends of one turn of the event loop together; more queue up while a
transaction is in flight. The thread takes everything queued (up to :data:`MAX_BATCH_EVENTS` per
transaction) and runs each whole transaction in one go, off the event loop: encoding each event
into its row (a call shares its prompt and request with its rollout's previous call, so only
what is new is packed and written: ``store.codec.encode_shared``), the checksum chain,
``BEGIN IMMEDIATE``, the check that nobody else moved the end of the log, one ``executemany``,
``COMMIT``. It then hands the outcome of the batch back to the event loop with one
``call_soon_threadsafe``, which settles every caller's future.

Invariants: a caller's future gets its positions only after the ``COMMIT`` holding its events
returned (durable: WAL with ``synchronous=FULL``); the events of one append are in one
transaction; an append with an event that cannot be encoded fails alone, before the
transaction; a failed transaction leaves nothing of its batch in the log, and the writer's
position, checksum and sharing state stay as they were before it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.errors import StoreError, StoreFull
from store.codec import EncodedEvent, chain_digest, encode, encode_shared
from store.events import Event, LLMCallCompleted, RolloutFinished

__all__ = ["COMMIT_BUCKETS_S", "MAX_BATCH_EVENTS", "Committed", "Pending", "Writer", "store_error"]

log = logging.getLogger(__name__)

#: Most events committed in one transaction (a single larger ``append`` still goes in one piece).
MAX_BATCH_EVENTS = 1024
#: Upper bounds, in seconds, of the buckets ``Writer.commit_buckets`` counts committed
#: transactions in by their SQL time (``BEGIN IMMEDIATE`` to ``COMMIT``, the fsync included).
COMMIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Rollouts whose last call the writer remembers for sharing (running ones; LRU beyond).
_SHARING_ROLLOUTS = 4096
#: A clean close checkpoints the WAL into the main file: tries, each waiting this long for
#: readers (milliseconds), with this pause between them (seconds).
_CHECKPOINT_TRIES = 5
_CHECKPOINT_BUSY_MS = 200
_CHECKPOINT_PAUSE_S = 0.1
_INSERT = (
    "INSERT INTO events (position, type, version, rollout, ts, data, blob, chain)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_HEAD = "SELECT COALESCE(MAX(position), 0) FROM events"
#: (position, event) of a rollout's last call.
_LastCall = tuple[int, LLMCallCompleted]
#: An event as committed: its position, the event appended, and its row.
Committed = tuple[int, Event, EncodedEvent]


@dataclass(slots=True)
class Pending:
    """One ``append`` call waiting for the writer: its events and its caller's future."""

    events: Sequence[Event]
    future: asyncio.Future[list[int]]


@dataclass(slots=True)
class _Call:
    """A function to run on the writer connection between two transactions (e.g. a PRAGMA)."""

    fn: Callable[[sqlite3.Connection], None]
    future: asyncio.Future[None]


class Writer:
    """The writer thread of one store. ``start`` it; ``stop`` commits what is queued and ends it."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        head: int,
        digest: bytes,
        *,
        share: bool,
        on_commit: Callable[[int, Sequence[Committed]], None],
    ) -> None:
        self.path = path
        #: Transactions committed (one per group commit).
        self.commits = 0
        #: Seconds the thread spent preparing batches (sharing, checksums) and in their SQL
        #: (``BEGIN IMMEDIATE`` to ``COMMIT``), for benchmarks.
        self.prepare_s = 0.0
        self.sql_s = 0.0
        #: Committed transactions by SQL time: one count per bound of :data:`COMMIT_BUCKETS_S`
        #: (at most that long, above the previous bound), the last for longer ones; and their
        #: seconds in all. Read by ``/metrics``.
        self.commit_buckets = [0] * (len(COMMIT_BUCKETS_S) + 1)
        self.committed_s = 0.0
        self._conn = conn
        self._head = head
        self._digest = digest
        self._share = share
        self._on_commit = on_commit
        self._last_call: OrderedDict[str, _LastCall] = OrderedDict()
        self._queue: queue.SimpleQueue[list[Pending] | _Call | None] = queue.SimpleQueue()
        self._loop = asyncio.get_running_loop()
        self._stopped: asyncio.Future[None] = self._loop.create_future()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"event store writer ({path.name})", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def submit(self, pending: list[Pending]) -> None:
        """Queue ``pending`` (in order); each future settles once its transaction committed or failed."""
        self._queue.put(pending)

    async def call(self, fn: Callable[[sqlite3.Connection], None]) -> None:
        """Run ``fn`` on the writer connection in the writer thread, between transactions."""
        call = _Call(fn, self._loop.create_future())
        self._queue.put(call)
        await call.future

    async def stop(self) -> None:
        """Commit everything queued before this call, then end the thread (idempotent)."""
        if not self._stopping:
            self._stopping = True
            self._queue.put(None)
        await asyncio.shield(self._stopped)

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close the connection (after ``stop``; blocks).

        A reader in the middle of a read (``status``, the dashboard) holds the WAL: retry briefly,
        then leave it; the next writer's open or close checkpoints it.
        """
        try:
            self._checkpoint()
        finally:
            self._conn.close()

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        backlog: deque[Pending] = deque()
        try:
            while True:
                item = self._queue.get()
                stop = item is None
                call = item if isinstance(item, _Call) else None
                if isinstance(item, list):
                    backlog.extend(item)
                    while True:  # whatever else is queued goes into the same transactions
                        try:
                            item = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if not isinstance(item, list):
                            stop, call = item is None, item
                            break
                        backlog.extend(item)
                while backlog:
                    batch = [backlog.popleft()]
                    size = len(batch[0].events)
                    while backlog and size + len(backlog[0].events) <= MAX_BATCH_EVENTS:
                        size += len(backlog[0].events)
                        batch.append(backlog.popleft())
                    self._commit(batch)
                if call is not None:
                    self._run_call(call)
                if stop:
                    return
        except BaseException:
            log.exception("event store %s: writer thread failed", self.path)
            raise
        finally:  # with work left only if the thread failed
            left: list[Pending | _Call] = list(backlog)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, list):
                    left += item
                elif item is not None:
                    left.append(item)
            error = StoreError(f"event store {self.path} writer stopped")
            self._settle([(p.future, error) for p in left])
            self._notify(lambda: None if self._stopped.done() else self._stopped.set_result(None))

    def _run_call(self, call: _Call) -> None:
        try:
            call.fn(self._conn)
        except BaseException as exc:
            self._settle([(call.future, exc)])
        else:
            self._settle([(call.future, None)])

    def _commit(self, batch: list[Pending]) -> None:
        began = time.perf_counter()
        start = position = self._head
        digest = self._digest
        sharing: dict[str, _LastCall | None] = {}  # changes to _last_call if it commits
        rows: list[tuple[Any, ...]] = []
        committed: list[Committed] = []
        committing: list[tuple[asyncio.Future[list[int]], list[int]]] = []
        refused: list[tuple[asyncio.Future[list[int]], BaseException]] = []
        encode_at = self._encode
        for pending in batch:
            events = pending.events
            changes: dict[str, _LastCall | None] = {}
            try:
                encoded = [encode_at(i, e, sharing, changes) for i, e in enumerate(events, position + 1)]
            except StoreError as exc:  # this append only: the others of the batch go on
                refused.append((pending.future, exc))
                continue
            except Exception as exc:  # an event no codec path foresaw (say, nested too deep)
                error = StoreError(f"cannot encode the events of an append: {exc!r}")
                error.__cause__ = exc
                refused.append((pending.future, error))
                continue
            if changes:
                sharing.update(changes)
            ids: list[int] = []
            for event, row in zip(events, encoded, strict=True):
                position += 1
                digest = chain_digest(digest, position, row)
                rows.append((position, *row, digest))  # the columns of _INSERT
                committed.append((position, event, row))
                ids.append(position)
            committing.append((pending.future, ids))
        if refused:
            self._settle(refused)
        if not rows:
            return
        conn = self._conn
        prepared = time.perf_counter()
        self.prepare_s += prepared - began
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                (head,) = conn.execute(_HEAD).fetchone()
                if head != start:
                    raise StoreError(
                        f"another process wrote to event store {self.path} (log ends at {head},"
                        f" this writer expected {start}); only one appliance may use a store"
                    )
                conn.executemany(_INSERT, rows)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # a failed COMMIT may have rolled back already
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
        except Exception as exc:  # the counter stays at ``start``: nothing of the batch exists
            if not isinstance(exc, StoreError):
                error = store_error(f"could not commit {len(rows)} events to {self.path}", exc)
                error.__cause__ = exc
                exc = error
            self._settle([(future, exc) for future, _ids in committing])
            return
        finally:
            took = time.perf_counter() - prepared
            self.sql_s += took
        self._head = position
        self._digest = digest
        self.commits += 1
        self.commit_buckets[bisect.bisect_left(COMMIT_BUCKETS_S, took)] += 1
        self.committed_s += took
        for rollout, last in sharing.items():
            self._last_call.pop(rollout, None)
            if last is not None:
                self._last_call[rollout] = last
        while len(self._last_call) > _SHARING_ROLLOUTS:
            self._last_call.popitem(last=False)
        self._settle(committing, head=position, committed=committed)

    def _encode(
        self,
        position: int,
        event: Event,
        sharing: dict[str, _LastCall | None],
        changes: dict[str, _LastCall | None],
    ) -> EncodedEvent:
        """The row of ``event`` at ``position``, its prompt and request shared with its rollout's
        previous call (the latest in ``changes``, then ``sharing``, then the committed log); notes
        in ``changes`` what later calls may share with."""
        if not self._share:
            return encode(event)
        if isinstance(event, LLMCallCompleted):
            rollout = event.rollout
            if rollout in changes:
                earlier = changes[rollout]
            elif rollout in sharing:
                earlier = sharing[rollout]
            else:
                earlier = self._last_call.get(rollout)
            row = encode(event) if earlier is None else encode_shared(event, *earlier)
            changes[rollout] = (position, event)
            return row
        if isinstance(event, RolloutFinished):
            changes[event.rollout] = None
        return encode(event)

    def _settle(
        self,
        outcomes: Sequence[tuple[asyncio.Future[Any], Any]],
        head: int | None = None,
        committed: Sequence[Committed] = (),
    ) -> None:
        """Hand a batch's outcomes (results, or exceptions) to the event loop in one call; after a
        commit, ``head`` is the new end of the log and ``committed`` what the batch wrote."""

        def settle() -> None:
            for future, outcome in outcomes:
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            if head is not None:
                self._on_commit(head, committed)

        self._notify(settle)

    def _notify(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(fn)

    def _checkpoint(self) -> None:
        for _ in range(_CHECKPOINT_TRIES):
            try:
                self._conn.execute(f"PRAGMA busy_timeout = {_CHECKPOINT_BUSY_MS}")
                (busy, _wal_pages, _copied) = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as exc:  # e.g. a full disk: the WAL still holds every event
                log.warning("event store %s: could not checkpoint the WAL on close: %s", self.path, exc)
                return
            if not busy:
                return
            time.sleep(_CHECKPOINT_PAUSE_S)
        log.warning(
            "event store %s: readers kept its WAL busy at close; its -wal file still holds events", self.path
        )


def store_error(message: str, exc: BaseException) -> StoreError:
    """``StoreFull`` for a full disk (or size cap), else ``StoreError``."""
    if isinstance(exc, sqlite3.Error) and (exc.sqlite_errorcode & 0xFF) == sqlite3.SQLITE_FULL:
        return StoreFull(
            f"{message}: the disk (or the store's size cap) is full; free space and retry ({exc})"
        )
    return StoreError(f"{message}: {exc!r}")
