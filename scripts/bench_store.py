"""Event store throughput and size, measured side by side in one run.

Prints:

1. Durable events/s on this disk: group commit (many concurrent appenders, as the proxy makes
   them) vs one commit per event (each append waits for its own commit), and the cost of the
   checksum chain per event next to the group-commit time per event.
2. How fast the chain of the resulting log verifies on open.
3. Bytes per stored token for long multi-call rollouts, with prefix sharing (a call's prompt
   stored as a reference to the rollout's previous call plus the new suffix) vs every call's
   tokens stored whole, and the time to read the log back both ways.

    .venv/bin/python scripts/bench_store.py [--events 20000] [--rollouts 32] [--calls 24]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from store import EventStore, LLMCallCompleted
from store.codec import chain_digest, encode
from store.eventstore import verify_log


def call(rollout: str, n: int, prompt: tuple[int, ...], response: tuple[int, ...]) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=time.time(),
        rollout=rollout,
        call_id=f"{rollout}-{n}",
        surface="openai.chat",
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=tuple(-0.5 for _ in response),
        policy_version=0,
        finish_reason="stop",
        request={"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 5?"}]},
        response_text="7",
        queue_s=0.001,
        total_s=0.01,
    )


def small_events(count: int) -> list[LLMCallCompleted]:
    """~330-byte rows: one short call per rollout (nothing to share)."""
    return [call(f"r{i}", 0, tuple(range(i % 7, i % 7 + 24)), (7, 8)) for i in range(count)]


async def group_commit(path: Path, events: list[LLMCallCompleted], appenders: int) -> tuple[float, int]:
    """``appenders`` tasks each appending one event at a time; returns (events/s, commits)."""
    async with await EventStore.open(path) as store:
        queue = iter(events)

        async def appender() -> None:
            for event in queue:
                await store.append([event])

        start = time.perf_counter()
        await asyncio.gather(*(appender() for _ in range(appenders)))
        elapsed = time.perf_counter() - start
        return len(events) / elapsed, store.commits


async def commit_per_event(path: Path, events: list[LLMCallCompleted]) -> float:
    async with await EventStore.open(path) as store:
        start = time.perf_counter()
        for event in events:
            await store.append([event])
        return len(events) / (time.perf_counter() - start)


def checksum_us(events: list[LLMCallCompleted]) -> float:
    rows = [encode(e) for e in events]
    digest = b""
    start = time.perf_counter()
    for position, row in enumerate(rows, 1):
        digest = chain_digest(digest, position, row)
    return (time.perf_counter() - start) / len(rows) * 1e6


def conversations(rollouts: int, calls: int, seed: int = 0) -> list[LLMCallCompleted]:
    """Agent-like rollouts: each prompt = previous prompt + response + a tool result (~150 tokens)."""
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(50_000) for _ in range(300)) for _ in range(rollouts)]
    out: list[LLMCallCompleted] = []
    for n in range(calls):
        for r in range(rollouts):
            response = tuple(rng.randrange(50_000) for _ in range(rng.randrange(20, 120)))
            out.append(call(f"agent{r}", n, prompts[r], response))
            prompts[r] = prompts[r] + response + tuple(rng.randrange(50_000) for _ in range(150))
    return out


async def stored_size(path: Path, events: list[LLMCallCompleted], share: bool) -> tuple[int, float]:
    """(database bytes after a checkpoint, seconds to read the whole log back)."""
    async with await EventStore.open(path, share_prefixes=share) as store:
        for i in range(0, len(events), 64):
            await store.append(events[i : i + 64])
    async with await EventStore.open(path, readonly=True) as reader:
        start = time.perf_counter()
        assert [s.event for s in await reader.read()] == events
        read_s = time.perf_counter() - start
    with contextlib.closing(sqlite3.connect(path)) as db:  # fold the WAL into the file
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return (await asyncio.to_thread(path.stat)).st_size, read_s


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--per-event", type=int, default=2_000, help="events for one commit per event")
    parser.add_argument("--appenders", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        events = small_events(args.events)
        row_bytes = sum(len(r.data) + len(r.blob) for r in map(encode, events[:100])) / 100
        # The same events, one run after the other: group commit vs one commit per event.
        same = events[: args.per_event]
        grouped_same, commits_same = await group_commit(root / "group-same.db", same, args.appenders)
        single = await commit_per_event(root / "single.db", same)
        grouped, commits = await group_commit(root / "group.db", events, args.appenders)
        digest_us = checksum_us(events)
        start = time.perf_counter()
        report = verify_log(root / "group.db")
        verify_s = time.perf_counter() - start

        print(f"## durable appends ({row_bytes:.0f}-byte rows, synchronous=FULL, WAL)")
        print(
            f"group commit, {args.appenders} appenders: {grouped_same:10.0f} events/s"
            f"  ({len(same)} events in {commits_same} commits)"
        )
        print(f"one commit per event:          {single:10.0f} events/s  ({len(same)} events)")
        print(f"ratio group / single:          {grouped_same / single:10.1f}x")
        print(
            f"group commit, longer run:      {grouped:10.0f} events/s"
            f"  ({args.events} events in {commits} commits, {args.events / commits:.0f}/commit)"
        )
        print(
            f"checksum chain: {digest_us:.2f} us/event = {digest_us * grouped / 1e6:.1%}"
            " of the group-commit time per event"
        )
        print(
            f"verify on open: {report.events / verify_s:.0f} events/s"
            f" ({report.events} events in {verify_s * 1000:.0f} ms)"
        )

        calls = conversations(args.rollouts, args.calls)
        tokens = sum(len(c.prompt_ids) + len(c.response_ids) for c in calls)
        shared_bytes, shared_read = await stored_size(root / "shared.db", calls, share=True)
        whole_bytes, whole_read = await stored_size(root / "whole.db", calls, share=False)
        print(
            f"\n## long rollouts ({args.rollouts} rollouts x {args.calls} calls,"
            f" {tokens / len(calls):.0f} prompt+response tokens per call, {tokens} in all)"
        )
        print(
            f"tokens stored whole:  {whole_bytes / tokens:6.2f} bytes/token"
            f"  ({whole_bytes / 2**20:.1f} MiB, read back in {whole_read:.2f} s)"
        )
        print(
            f"prefix sharing:       {shared_bytes / tokens:6.2f} bytes/token"
            f"  ({shared_bytes / 2**20:.1f} MiB, read back in {shared_read:.2f} s)"
        )
        print(
            f"ratio whole / shared: {whole_bytes / shared_bytes:6.1f}x the bytes;"
            f" reading back with sharing takes {shared_read / whole_read:.2f}x the time"
        )


if __name__ == "__main__":
    asyncio.run(main())
