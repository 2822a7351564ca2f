"""EventStore against real SQLite files: ordering, group commit, atomicity, durability, reads."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from contracts.errors import StoreError
from store import ApplianceStopped, EventStore, LLMCallCompleted, RewardReported, StoredEvent
from store.eventstore import read_events_sync, read_last_sync, verify_log
from store.tokens import Tokens

REPO = Path(__file__).resolve().parents[2]


def reward(i: int, rollout: str = "r") -> RewardReported:
    return RewardReported(ts=float(i), rollout=rollout, reward=float(i), source="test")


def call(rollout: str, n: int) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=1.0,
        rollout=rollout,
        call_id=f"{rollout}-c",
        surface="openai.chat",
        prompt_ids=Tokens(tuple(range(n))),
        response_ids=Tokens((7, 8)),
        response_logprobs=(-0.5, -0.25),
        policy_version=0,
        finish_reason="stop",
        request={"model": "m"},
        response_text="hi",
        queue_s=0.0,
        total_s=0.5,
    )


@pytest_asyncio.fixture(loop_scope="function")  # the store's writer task lives in the test's loop
async def store(tmp_path: Path) -> AsyncIterator[EventStore]:
    store = await EventStore.open(tmp_path / "events.db")
    yield store
    await store.close()


async def test_append_returns_contiguous_positions_and_read_returns_them_in_order(store: EventStore) -> None:
    assert store.last_position == 0
    assert await store.append([reward(1), reward(2)]) == [1, 2]
    assert await store.append([reward(3)]) == [3]
    assert await store.append([]) == []
    stored = await store.read()
    assert [s.position for s in stored] == [1, 2, 3]
    assert [s.event for s in stored] == [reward(1), reward(2), reward(3)]
    assert store.last_position == 3
    assert [s.position for s in await store.read(after=1, limit=1)] == [2]


async def test_concurrent_appends_share_transactions(store: EventStore) -> None:
    results = await asyncio.gather(*(store.append([reward(i), reward(i)]) for i in range(200)))
    assert sorted(p for ids in results for p in ids) == list(range(1, 401))
    for i, ids in enumerate(results):  # each call's events are adjacent and in its order
        assert ids[1] == ids[0] + 1
        assert [s.event for s in await store.read(after=ids[0] - 1, limit=2)] == [reward(i), reward(i)]
    assert store.commits < 10, f"{store.commits} transactions for 200 concurrent appends"


async def test_a_failed_commit_writes_nothing_of_the_append_and_reuses_its_positions(
    store: EventStore,
) -> None:
    await store.append([reward(0)])
    with sqlite3.connect(store.path) as db:  # make the second event of the next append fail
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.type = 'ApplianceStopped'"
            " BEGIN SELECT RAISE(ABORT, 'refused by test'); END"
        )
    with pytest.raises(StoreError, match="refused by test"):
        await store.append([reward(1), ApplianceStopped(ts=0.0, reason="x"), reward(2)])
    assert [s.position for s in await store.read()] == [1]
    assert store.last_position == 1
    with sqlite3.connect(store.path) as db:
        db.execute("DROP TRIGGER refuse")
    assert await store.append([reward(3)]) == [2]
    assert [s.event for s in await store.read()] == [reward(0), reward(3)]


async def test_events_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    store = await EventStore.open(path)
    await store.append([call("a", 5), reward(1, "a")])
    await store.close()
    await store.close()  # idempotent

    store = await EventStore.open(path)
    assert store.last_position == 2
    assert [s.event for s in await store.read()] == [call("a", 5), reward(1, "a")]
    assert await store.append([reward(2)]) == [3]
    await store.close()
    assert [s.position for s in read_events_sync(path)] == [1, 2, 3]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_close_commits_queued_appends_then_refuses_new_ones(tmp_path: Path) -> None:
    store = await EventStore.open(tmp_path / "events.db")
    pending = [asyncio.ensure_future(store.append([reward(i)])) for i in range(5)]
    await asyncio.sleep(0)  # the appends are queued, not yet committed
    await asyncio.gather(store.close(), store.close())
    assert [await p for p in pending] == [[1], [2], [3], [4], [5]]
    with pytest.raises(StoreError, match="closed"):
        await store.append([reward(6)])
    with pytest.raises(StoreError, match="closed"):
        await store.read()
    assert len(read_events_sync(store.path)) == 5


async def test_close_leaves_every_event_in_the_main_file(tmp_path: Path) -> None:
    """After a clean close, ``events.sqlite`` alone is the whole log: copying it copies the run."""
    path = tmp_path / "events.sqlite"
    store = await EventStore.open(path)
    events = [call("a", 50), call("a", 60), *(reward(i) for i in range(300))]
    await store.append(events)
    # A reader (the dashboard, ``status``) has the file open between two reads: the writer's
    # close is not the last one, which would have checkpointed by itself.
    with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as reader:
        assert reader.execute("SELECT COUNT(*) FROM events").fetchone() == (len(events),)
        await store.close()
        wal = path.with_name(path.name + "-wal")
        assert not wal.exists() or wal.stat().st_size == 0
        (tmp_path / "copy").mkdir()
        copy = Path(shutil.copy(path, tmp_path / "copy" / path.name))
    assert [s.event for s in read_events_sync(copy)] == events
    assert verify_log(copy).events == len(events)


async def test_close_does_not_wait_long_for_a_reader_that_holds_the_wal(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    store = await EventStore.open(path)
    await store.append([reward(i) for i in range(10)])
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as reader:
        reader.execute("BEGIN")  # a read transaction pins the WAL: no TRUNCATE checkpoint
        reader.execute("SELECT COUNT(*) FROM events").fetchone()
        started = time.monotonic()
        await asyncio.wait_for(store.close(), 10)
        assert time.monotonic() - started < 5
        reader.execute("COMMIT")
    assert len(read_events_sync(path)) == 10


async def test_read_last_sync_reads_the_last_event_of_a_type(store: EventStore) -> None:
    assert read_last_sync(store.path, {"RewardReported"}) is None
    await store.append([reward(1), call("a", 5), reward(2), call("b", 3)])
    last = read_last_sync(store.path, {"RewardReported"})
    assert last is not None and (last.position, last.event) == (3, reward(2))
    last = read_last_sync(store.path, {"RewardReported", "LLMCallCompleted"})
    assert last is not None and (last.position, last.event) == (4, call("b", 3))


CHILD = """
import asyncio, sys
from pathlib import Path
from store import EventStore, RewardReported

async def main() -> None:
    store = await EventStore.open(Path(sys.argv[1]))
    i = 0
    while True:
        batch = [RewardReported(ts=0.0, rollout=f"r{i + k}", reward=float(i + k), source="child")
                 for k in range(3)]
        positions = await store.append(batch)
        print(" ".join(map(str, positions)), flush=True)
        i += 3

asyncio.run(main())
"""


def test_acknowledged_events_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None and child.stderr is not None
    acked: list[int] = []
    deadline = time.monotonic() + 60
    try:
        while len(acked) < 300 and time.monotonic() < deadline:
            line = child.stdout.readline()
            assert line, f"child exited early: {child.stderr.read()}"
            acked += map(int, line.split())
            if len(acked) == 150:  # a second process reads while the child writes
                seen = read_events_sync(path)
                assert [s.position for s in seen] == list(range(1, len(seen) + 1))
                assert len(seen) >= 150
    finally:
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    acked += (int(p) for p in rest.split())  # acknowledged between our last read and the kill
    assert acked == list(range(1, len(acked) + 1))

    stored = read_events_sync(path)
    assert len(stored) >= len(acked)
    for s in stored:
        assert s.event == RewardReported(
            ts=0.0, rollout=f"r{s.position - 1}", reward=s.position - 1.0, source="child"
        )


async def test_sigkilled_store_reopens_for_writing(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    script = CHILD.replace("while True:", "while i < 30:") + "\nimport os, signal\nos.kill(os.getpid(), 9)\n"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(path), env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert await proc.wait() == -signal.SIGKILL
    async with await EventStore.open(path) as store:
        assert store.last_position == 30
        assert await store.append([reward(0)]) == [31]


async def test_subscribe_yields_backlog_then_live_events_and_ends_on_close(store: EventStore) -> None:
    await store.append([reward(1), reward(2), reward(3)])
    seen: asyncio.Queue[StoredEvent] = asyncio.Queue()

    async def follow() -> None:
        async for stored in store.subscribe(after=1):
            seen.put_nowait(stored)

    async def next_seen() -> StoredEvent:
        return await asyncio.wait_for(seen.get(), 5)

    follower = asyncio.create_task(follow())
    assert [(await next_seen()).position for _ in range(2)] == [2, 3]  # the backlog
    assert seen.empty()
    await store.append([reward(4)])
    assert await next_seen() == StoredEvent(4, reward(4))
    await store.append([reward(5), reward(6)])
    assert [(await next_seen()).event for _ in range(2)] == [reward(5), reward(6)]
    await store.close()
    await asyncio.wait_for(follower, 5)
    assert seen.empty()


async def test_subscribe_pages_through_a_long_backlog(store: EventStore) -> None:
    await store.append([reward(i) for i in range(1300)])
    positions: list[int] = []
    async for stored in store.subscribe():
        positions.append(stored.position)
        if stored.position == 1300:
            break
    assert positions == list(range(1, 1301))


async def test_read_filters_by_type_and_rollout(store: EventStore) -> None:
    await store.append([call("a", 3), reward(1, "a"), call("b", 2), ApplianceStopped(ts=0.0, reason="x")])
    assert [s.position for s in await store.read(types={"LLMCallCompleted"})] == [1, 3]
    assert [s.position for s in await store.read(rollout="a")] == [1, 2]
    assert [s.position for s in await store.read(types=["RewardReported"], rollout="b")] == []
    types = ["LLMCallCompleted", "ApplianceStopped"]
    assert [s.position for s in await store.read(after=1, types=types)] == [3, 4]
    assert await store.read(types=[]) == []


async def test_readonly_store_reads_but_refuses_appends(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    async with await EventStore.open(path) as writer:
        await writer.append([reward(1)])
        async with await EventStore.open(path, readonly=True) as reader:
            assert reader.readonly
            assert [s.event for s in await reader.read()] == [reward(1)]
            with pytest.raises(StoreError, match="read-only"):
                await reader.append([reward(2)])
            await writer.append([reward(2)])
            async for stored in reader.subscribe(after=1):  # sees the other writer's commit
                assert stored.event == reward(2)
                break
            assert reader.last_position == 2


async def test_readonly_open_of_a_missing_store_fails(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such file"):
        await EventStore.open(tmp_path / "missing.db", readonly=True)
    assert not (tmp_path / "missing.db").exists()


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    await (await EventStore.open(path)).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    for readonly in (False, True):
        with pytest.raises(StoreError, match="schema version 9, newer"):
            await EventStore.open(path, readonly=readonly)
    with pytest.raises(StoreError, match="schema version 9"):
        read_events_sync(path)


async def test_a_foreign_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    with pytest.raises(StoreError, match="not an event store"):
        await EventStore.open(path)


async def test_another_writer_is_detected(store: EventStore) -> None:
    await store.append([reward(1)])
    with sqlite3.connect(store.path) as db:
        db.execute("INSERT INTO events VALUES (2, 'RewardReported', 1, 'r', 0, '{}', x'', NULL)")
    with pytest.raises(StoreError, match="another process wrote"):
        await store.append([reward(2)])


def _open_fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
async def test_open_and_close_leak_no_file_descriptors(tmp_path: Path) -> None:
    async def cycle() -> None:
        store = await EventStore.open(tmp_path / "events.db")
        await store.append([reward(1)])
        await store.read()
        await store.close()

    await cycle()  # warm up lazily created descriptors
    before = _open_fds()
    for _ in range(5):
        await cycle()
    assert _open_fds() == before


async def test_an_event_that_cannot_be_encoded_fails_its_append_alone(store: EventStore) -> None:
    good = [ApplianceStopped(ts=float(i), reason=f"fine {i}") for i in range(3)]
    bad = ApplianceStopped(ts=9.0, reason="broken \ud800 text")
    # All four appends of one turn go to the writer together: only the bad one fails.
    results = await asyncio.gather(
        store.append([good[0]]), store.append([good[1], bad]), store.append([good[2]]), return_exceptions=True
    )
    assert results[0] == [1] and results[2] == [2]
    assert isinstance(results[1], StoreError) and "cannot encode" in str(results[1])
    assert [s.event for s in await store.read()] == [good[0], good[2]]
    assert (await store.verify()).events == 2


async def test_an_event_too_deep_to_encode_fails_its_append_and_the_writer_goes_on(store: EventStore) -> None:
    deep: list[Any] = []
    for _ in range(100_000):  # deeper than either JSON encoder recurses
        deep = [deep]
    bad = dataclasses.replace(call("a", 2), request={"messages": deep})
    with pytest.raises(StoreError, match="cannot encode"):
        await asyncio.wait_for(store.append([bad]), 10)
    assert await asyncio.wait_for(store.append([reward(1)]), 10) == [1]


async def test_a_lone_surrogate_is_refused_and_the_writer_goes_on(store: EventStore) -> None:
    bad = ApplianceStopped(ts=1.0, reason="broken \ud800 text")
    with pytest.raises(StoreError, match="cannot encode"):
        await store.append([bad])
    with pytest.raises(StoreError, match="cannot encode"):
        await store.append([RewardReported(ts=1.0, rollout="r\udfff", reward=1.0, source="agent")])
    # The writer is still alive: later appends commit and read back.
    (position,) = await asyncio.wait_for(store.append([ApplianceStopped(ts=2.0, reason="fine")]), 10)
    assert [s.event for s in await store.read()] == [ApplianceStopped(ts=2.0, reason="fine")]
    assert position == 1
