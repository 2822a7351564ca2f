"""Rows read back as events: a call's shared prompt and request rebuilt from the earlier call.

Owns :class:`RowDecoder` (rows -> events, keeping recent calls' tokens and requests, within a
bound, for the later calls that share them), finding the earlier calls a page of rows refers to,
and :func:`select_sync`, one read-only query of the log, decoded. It does not own the SQL schema
(``store.schema``), a row's layout (``store.codec``) nor the store's connections
(``store.eventstore``).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from contracts.errors import StoreCorrupted, StoreError
from store.codec import StoredEvent, decode, prefix_source, shared_ref
from store.events import JsonObject, LLMCallCompleted
from store.schema import CALLS_BETWEEN, Row, connect_readonly
from store.tokens import Tokens

#: Tokens (of recent calls) a reader keeps to rebuild later calls' shared prefixes: 4 bytes each
#: (their requests are kept along, the messages shared with the next call's).
_DECODED_TOKENS = 4_000_000


class RowDecoder:
    """Rows -> events, rebuilding shared prefixes and requests from earlier calls (an LRU cache)."""

    def __init__(self) -> None:
        self._sources: OrderedDict[int, tuple[Tokens, JsonObject]] = OrderedDict()
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

    def _remember(self, position: int, source: tuple[Tokens, JsonObject]) -> None:
        old = self._sources.pop(position, None)
        self._tokens += len(source[0]) - (0 if old is None else len(old[0]))
        self._sources[position] = source
        while self._tokens > _DECODED_TOKENS and len(self._sources) > 1:
            self._tokens -= len(self._sources.popitem(last=False)[1][0])

    def decode(self, rows: Sequence[Row]) -> list[StoredEvent]:
        """Decode ``rows`` (in position order, each reference among them or in the cache)."""
        local: dict[int, tuple[Tokens, JsonObject]] = {}
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


def select_sync(
    path: Path, sql: str, params: tuple[Any, ...], decoder: RowDecoder | None = None
) -> list[StoredEvent]:
    """The events of the rows ``sql`` selects (``COLUMNS``, in position order), decoded (with
    ``decoder``'s remembered prompts, when one is given)."""
    if decoder is None:
        decoder = RowDecoder()
    try:
        conn, _version = connect_readonly(path)
        with contextlib.closing(conn):
            selected = conn.execute(sql, params).fetchall()
            wanted = {row[0] for row in selected}
            merged, last_need = selected, None
            while (need := decoder.missing(merged)) is not None:
                check_progress(path, need, last_need)
                last_need = need
                merged = merge(merged, conn.execute(CALLS_BETWEEN, need).fetchall())
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read event store {path}: {exc}") from exc
    return [s for s in decoder.decode(merged) if s.position in wanted]


def merge(rows: Iterable[Row], more: Iterable[Row]) -> list[Row]:
    """Both row lists as one, by position, without duplicates."""
    return sorted({row[0]: row for row in [*rows, *more]}.values(), key=lambda row: int(row[0]))


def check_progress(
    path: Path, need: tuple[str, str, int, int], last: tuple[str, str, int, int] | None
) -> None:
    """Refuse a log whose rows refer to a call it does not hold: fetching the calls ``need``
    names (as it did ``last`` time) found nothing more."""
    if need == last:
        raise StoreCorrupted(
            f"event store {path} is corrupted: the event at {need[3]} shares tokens with a call"
            f" at {need[2]} that is not in the log"
        )
