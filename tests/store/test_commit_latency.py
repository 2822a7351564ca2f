"""The writer counts each committed transaction's SQL time in buckets (read by ``/metrics``)."""

from __future__ import annotations

import time
from pathlib import Path

from store.events import ApplianceStopped
from store.eventstore import EventStore
from store.writer import COMMIT_BUCKETS_S


async def test_every_commit_is_counted_once_by_its_sql_time(tmp_path: Path) -> None:
    async with await EventStore.open(tmp_path / "events.db") as store:
        assert store.commit_latency == ([0] * (len(COMMIT_BUCKETS_S) + 1), 0.0)
        for _ in range(3):
            await store.append([ApplianceStopped(ts=time.time(), reason="x")])
        counts, total_s = store.commit_latency
        assert len(counts) == len(COMMIT_BUCKETS_S) + 1
        assert sum(counts) == store.commits == 3
        assert 0 < total_s <= store.writer_seconds[1]
