"""The writer's transactions: an append larger than a batch still commits whole, in order, chained."""

from __future__ import annotations

from pathlib import Path

from store import EventStore, RewardReported
from store.eventstore import verify_log
from store.writer import MAX_BATCH_EVENTS


async def test_one_append_larger_than_a_batch_commits_whole_and_chained(tmp_path: Path) -> None:
    count = MAX_BATCH_EVENTS + 77
    events = [
        RewardReported(ts=float(i), rollout=f"r{i % 5}", reward=i / count, source="t") for i in range(count)
    ]
    async with await EventStore.open(tmp_path / "events.db") as store:
        positions = await store.append(events)
        assert positions == list(range(1, count + 1))
        assert [s.event for s in await store.read()] == events
        assert store.commits == 1
    assert verify_log(tmp_path / "events.db").events == count
