"""The checksum chain: verified on open, tampering and gaps refused, v1 stores migrated, disk full."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from contracts.errors import StoreCorrupted, StoreError, StoreFull
from store import EventStore, LLMCallCompleted, RewardReported
from store.codec import encode
from store.eventstore import read_events_sync, verify_log
from store.schema import SCHEMA_VERSION
from store.tokens import Tokens


def reward(i: int, rollout: str = "r") -> RewardReported:
    return RewardReported(ts=float(i), rollout=rollout, reward=float(i), source="test")


def big_call(i: int) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=1.0,
        rollout=f"big{i}",  # one call per rollout: nothing shared, each row ~40 KB
        call_id=f"c{i}",
        surface="openai.chat",
        prompt_ids=Tokens(tuple(range(i, i + 10_000))),
        response_ids=Tokens((7, 8)),
        response_logprobs=(-0.5, -0.25),
        policy_version=0,
        finish_reason="stop",
        request={"model": "m"},
        response_text="hi",
        queue_s=0.0,
        total_s=0.5,
    )


async def test_the_chain_verifies_after_appends_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    async with await EventStore.open(path) as store:
        await store.append([reward(i) for i in range(10)])
        await store.append([reward(10)])
        report = await store.verify()
        assert report.events == 11
    async with await EventStore.open(path) as store:  # verified on open; the chain continues
        assert await store.append([reward(11)]) == [12]
    report = verify_log(path)
    assert report.events == 12
    with sqlite3.connect(path) as db:
        last = db.execute("SELECT chain FROM events WHERE position = 12").fetchone()[0]
    assert report.digest == last and len(last) == 16


async def test_a_changed_row_is_refused_on_open_with_its_position(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    async with await EventStore.open(path) as store:
        await store.append([reward(i) for i in range(5)])
    with sqlite3.connect(path) as db:
        db.execute(
            """UPDATE events SET data = replace(data, '"reward":2.0', '"reward":9.0') WHERE position = 3"""
        )
    with pytest.raises(StoreCorrupted, match="corrupted at position 3"):
        await EventStore.open(path)
    async with await EventStore.open(path, readonly=True) as reader:  # readers can still look
        assert len(await reader.read()) == 5
        with pytest.raises(StoreCorrupted, match="position 3"):
            await reader.verify()
    async with await EventStore.open(path, verify=False) as store:  # explicit opt-out
        assert store.last_position == 5


async def test_a_missing_row_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    async with await EventStore.open(path) as store:
        await store.append([reward(i) for i in range(5)])
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM events WHERE position = 2")
    with pytest.raises(StoreCorrupted, match="position 2 is missing"):
        verify_log(path)


async def test_a_failed_commit_leaves_the_chain_intact(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    async with await EventStore.open(path) as store:
        await store.append([reward(0)])
        with sqlite3.connect(path) as db:
            db.execute("CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'no'); END")
        with pytest.raises(StoreError, match="no"):
            await store.append([reward(1)])
        with sqlite3.connect(path) as db:
            db.execute("DROP TRIGGER refuse")
        assert await store.append([reward(2)]) == [2]
    assert verify_log(path).events == 2


V1_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE events (position INTEGER PRIMARY KEY, type TEXT NOT NULL, version INTEGER NOT NULL,"
    " rollout TEXT, ts REAL NOT NULL, data TEXT NOT NULL, blob BLOB NOT NULL)",
    "CREATE INDEX events_rollout ON events (rollout)",
    "INSERT INTO meta VALUES ('schema_version', '1')",
)


async def test_a_version_1_store_gets_checksums_when_opened_for_writing(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    old = [reward(i) for i in range(3)] + [big_call(0)]
    with sqlite3.connect(path) as db:  # a store as the previous release wrote it
        for statement in V1_SCHEMA:
            db.execute(statement)
        for position, event in enumerate(old, 1):
            r = encode(event)
            db.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                (position, r.type, r.version, r.rollout, r.ts, r.data, r.blob),
            )
    assert [s.event for s in read_events_sync(path)] == old  # readers take v1 as it is
    with pytest.raises(StoreError, match="no checksums yet"):
        verify_log(path)

    async with await EventStore.open(path) as store:
        assert [s.event for s in await store.read()] == old
        assert await store.append([reward(9)]) == [5]
    assert verify_log(path).events == 5
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )


async def test_a_full_disk_fails_appends_cleanly_and_the_store_recovers(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    async with await EventStore.open(path, max_bytes=400_000) as store:
        acknowledged: list[int] = []
        with pytest.raises(StoreFull, match="full; free space") as caught:
            for i in range(100):
                acknowledged += await store.append([big_call(i)])
        assert caught.value.status == 507
        assert 0 < len(acknowledged) < 100
        with pytest.raises(StoreFull):  # still full: still refused, nothing half-written
            await store.append([big_call(1000)])
        assert store.last_position == len(acknowledged)
    # Space returns (no cap): the store opens, the chain verifies, appends continue after the last
    # acknowledged event.
    async with await EventStore.open(path) as store:
        assert [s.event for s in await store.read()] == [big_call(i) for i in range(len(acknowledged))]
        assert await store.append([reward(1)]) == [len(acknowledged) + 1]
    assert verify_log(path).events == len(acknowledged) + 1
