"""Event store throughput and size, measured side by side in one run.

Prints:

1. Durable events/s at 64 and 512 concurrent appenders (each appending one event at a time and
   waiting for its commit, as the proxy's calls do), next to SQLite alone doing the same
   transactions of 64 and 512 ready-made rows (BEGIN IMMEDIATE, head check, executemany, COMMIT)
   through stdlib sqlite3 and through aiosqlite, and the ratios (the store twice: with Python's
   collector as it comes, and as a started appliance runs it); then group commit vs one commit
   per event, and the cost of the checksum chain per event.
2. How fast the chain of the resulting log verifies on open.
3. Bytes per stored token for long multi-call rollouts, with sharing (a call's prompt stored as a
   reference to the rollout's previous call plus the new suffix, its request as the messages
   after the previous call's) vs every call stored whole, the bytes of the requests alone, and
   the time to read the log back both ways.
4. The memory the run's folded state (``RunState``, what the live projection and the dashboard
   hold) keeps as training steps consume those rollouts, next to the memory of the calls the
   steps released (what the state held when it kept every call for the life of the process).

``--profile`` adds where the time of a 64-appender run goes (cProfile, event-loop thread).

    .venv/bin/python scripts/bench_store.py [--events 20000] [--rounds 3] [--rollouts 32] [--calls 24]
        [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import pstats
import random
import sqlite3
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite

from appliance.operations.collector import GC_YOUNG_THRESHOLD, serving_collector
from store import (
    EventStore,
    LLMCallCompleted,
    RewardReported,
    RolloutCreated,
    RolloutFinished,
    RunState,
    TrainStepCompleted,
)
from store.codec import chain_digest, encode
from store.eventstore import verify_log
from store.tokens import Tokens

_TABLE = (
    "CREATE TABLE events (position INTEGER PRIMARY KEY, type TEXT NOT NULL, version INTEGER NOT NULL,"
    " rollout TEXT, ts REAL NOT NULL, data TEXT NOT NULL, blob BLOB NOT NULL, chain BLOB)"
)
_INSERT = "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_HEAD = "SELECT COALESCE(MAX(position), 0) FROM events"


def call(
    rollout: str,
    n: int,
    prompt: tuple[int, ...],
    response: tuple[int, ...],
    messages: list[dict[str, Any]] | None = None,
) -> LLMCallCompleted:
    if messages is None:
        messages = [{"role": "user", "content": "What is 2 + 5?"}]
    return LLMCallCompleted(
        ts=time.time(),
        rollout=rollout,
        call_id=f"{rollout}-{n}",
        surface="openai.chat",
        prompt_ids=Tokens(prompt),
        response_ids=Tokens(response),
        response_logprobs=tuple(-0.5 for _ in response),
        policy_version=0,
        finish_reason="stop",
        request={"model": "tiny", "messages": messages},
        response_text="7",
        queue_s=0.001,
        total_s=0.01,
    )


def small_events(count: int) -> list[LLMCallCompleted]:
    """~330-byte rows: one short call per rollout (nothing to share)."""
    return [call(f"r{i}", 0, tuple(range(i % 7, i % 7 + 24)), (7, 8)) for i in range(count)]


@dataclass(frozen=True, slots=True)
class GroupRun:
    """One group-commit run: its throughput, and where the writer thread's time went."""

    rate: float
    commits: int
    elapsed: float
    prepare_s: float
    sql_s: float


async def group_commit(path: Path, events: list[LLMCallCompleted], appenders: int) -> GroupRun:
    """``appenders`` tasks each appending one event at a time (and waiting for its commit)."""
    async with await EventStore.open(path) as store:
        queue = iter(events)

        async def appender() -> None:
            for event in queue:
                await store.append([event])

        start = time.perf_counter()
        await asyncio.gather(*(appender() for _ in range(appenders)))
        elapsed = time.perf_counter() - start
        return GroupRun(len(events) / elapsed, store.commits, elapsed, *store.writer_seconds)


async def asyncio_alone(count: int, appenders: int) -> float:
    """Events/s of the appenders' part alone: each awaits a future that is settled, with those of
    every other append of the same turn of the event loop, on the next turn (no encoding, no SQL)."""
    loop = asyncio.get_running_loop()
    outbox: list[asyncio.Future[int]] = []

    def settle() -> None:
        for future in outbox:
            future.set_result(0)
        outbox.clear()

    async def append() -> int:
        future: asyncio.Future[int] = loop.create_future()
        outbox.append(future)
        if len(outbox) == 1:
            loop.call_soon(settle)
        return await future

    queue = iter(range(count))

    async def appender() -> None:
        for _ in queue:
            await append()

    start = time.perf_counter()
    await asyncio.gather(*(appender() for _ in range(appenders)))
    return count / (time.perf_counter() - start)


def raw_rows(events: list[LLMCallCompleted]) -> list[tuple[Any, ...]]:
    """The events as ready-made rows (encoded, chained) for the SQLite-alone baselines."""
    rows, digest = [], b""
    for position, row in enumerate(map(encode, events), 1):
        digest = chain_digest(digest, position, row)
        rows.append((position, row.type, row.version, row.rollout, row.ts, row.data, row.blob, digest))
    return rows


def raw_sqlite3(path: Path, rows: list[tuple[Any, ...]], per_commit: int) -> float:
    """Events/s committing ``rows`` ``per_commit`` at a time with stdlib sqlite3, nothing else."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        db.execute(_TABLE)
        start = time.perf_counter()
        for i in range(0, len(rows), per_commit):
            db.execute("BEGIN IMMEDIATE")
            db.execute(_HEAD).fetchone()
            db.executemany(_INSERT, rows[i : i + per_commit])
            db.execute("COMMIT")
        return len(rows) / (time.perf_counter() - start)


async def raw_aiosqlite(path: Path, rows: list[tuple[Any, ...]], per_commit: int) -> float:
    """As :func:`raw_sqlite3`, through aiosqlite (one hop to its thread per statement)."""
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await db.execute("PRAGMA journal_mode = WAL")
        await db.execute("PRAGMA synchronous = FULL")
        await db.execute(_TABLE)
        start = time.perf_counter()
        for i in range(0, len(rows), per_commit):
            await db.execute("BEGIN IMMEDIATE")
            await db.execute_fetchall(_HEAD)
            await db.executemany(_INSERT, rows[i : i + per_commit])
            await db.execute("COMMIT")
        return len(rows) / (time.perf_counter() - start)


def profile_top(path: Path, events: list[LLMCallCompleted], appenders: int, lines: int = 14) -> str:
    """cProfile of a group-commit run (the event-loop thread), by own time."""
    profiler = cProfile.Profile()
    profiler.runcall(asyncio.run, group_commit(path, events, appenders))
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


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


def conversations(rollouts: int, calls: int, seed: int = 0, prefix: str = "agent") -> list[LLMCallCompleted]:
    """Agent-like rollouts: each prompt = previous prompt + response + a tool result (~150 tokens),
    each request the whole conversation so far (messages), as chat harnesses send it."""
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(50_000) for _ in range(300)) for _ in range(rollouts)]
    histories: list[list[dict[str, Any]]] = [
        [
            {"role": "system", "content": "You are an agent. " * 40},
            {"role": "user", "content": "Fix the bug."},
        ]
        for _ in range(rollouts)
    ]
    out: list[LLMCallCompleted] = []
    for n in range(calls):
        for r in range(rollouts):
            response = tuple(rng.randrange(50_000) for _ in range(rng.randrange(20, 120)))
            out.append(call(f"{prefix}{r}", n, prompts[r], response, list(histories[r])))
            prompts[r] = prompts[r] + response + tuple(rng.randrange(50_000) for _ in range(150))
            histories[r] += [
                {"role": "assistant", "content": f"step {n}: " + "x" * len(response) * 4},
                {"role": "tool", "tool_call_id": f"t{n}", "content": "output line\n" * 50},
            ]
    return out


def long_conversation(tokens: int, calls: int, seed: int = 0) -> list[LLMCallCompleted]:
    """One rollout whose first prompt holds ``tokens`` tokens (and ~4 characters of messages per
    token), then ``calls`` more calls, each adding the response and a ~60-token user turn."""
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(50_000) for _ in range(tokens))
    turns = max(1, tokens // 600)
    messages: list[dict[str, Any]] = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 480} for i in range(turns)
    ]
    out: list[LLMCallCompleted] = []
    for n in range(calls + 1):
        response = tuple(rng.randrange(50_000) for _ in range(10))
        out.append(call("long", n, prompt, response, list(messages)))
        prompt = prompt + response + tuple(rng.randrange(50_000) for _ in range(60))
        messages += [{"role": "assistant", "content": "x " * 20}, {"role": "user", "content": "word " * 40}]
    return out


async def history_cost(path: Path, tokens: int, calls: int) -> float:
    """The process's CPU time (every thread) per durable append of one call of a long rollout,
    in microseconds: what recording a call costs as its conversation grows."""
    events = long_conversation(tokens, calls)
    async with await EventStore.open(path) as store:
        await store.append(events[:1])  # the rollout's first call is stored whole
        start = time.process_time()
        for event in events[1:]:
            await store.append([event])
        return (time.process_time() - start) / calls * 1e6


def traced_bytes() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def state_memory(steps: int, rollouts: int, calls: int) -> list[tuple[int, int, int]]:
    """(steps, bytes the folded state holds, bytes of the calls those steps released) after each
    of ``steps`` training steps, each consuming ``rollouts`` fresh rollouts of ``calls`` calls."""
    tracemalloc.start()
    try:
        state, released, out = RunState(), 0, []
        base = traced_bytes()
        for n in range(1, steps + 1):
            before = traced_bytes()
            events = conversations(rollouts, calls, seed=n, prefix=f"s{n}-")
            released += traced_bytes() - before  # what keeping this step's calls costs
            names = sorted({e.rollout for e in events})
            for rollout in names:
                state.apply(
                    RolloutCreated(
                        ts=0.0,
                        rollout=rollout,
                        task_id=rollout,
                        group=f"g{n}",
                        task={},
                        policy_version=n,
                        adapter="python",
                    )
                )
            for event in events:
                state.apply(event)
            for rollout in names:
                state.apply(RewardReported(ts=0.0, rollout=rollout, reward=1.0, source="bench"))
                state.apply(RolloutFinished(ts=0.0, rollout=rollout, status="finished"))
            state.apply(
                TrainStepCompleted(
                    ts=0.0,
                    step=n,
                    rollouts=tuple(names),
                    samples=len(names),
                    tokens=0,
                    zero_variance_groups=0,
                )
            )
            del events
            out.append((n, traced_bytes() - base, released))
        return out
    finally:
        tracemalloc.stop()


async def stored_size(path: Path, events: list[LLMCallCompleted], share: bool) -> tuple[int, int, float]:
    """(database bytes after a checkpoint, bytes of the JSON column, seconds to read the log back)."""
    async with await EventStore.open(path, share_prefixes=share) as store:
        for i in range(0, len(events), 64):
            await store.append(events[i : i + 64])
    async with await EventStore.open(path, readonly=True) as reader:
        start = time.perf_counter()
        assert [s.event for s in await reader.read()] == events
        read_s = time.perf_counter() - start
    with contextlib.closing(sqlite3.connect(path)) as db:  # fold the WAL into the file
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (data_bytes,) = db.execute("SELECT SUM(LENGTH(CAST(data AS BLOB))) FROM events").fetchone()
    return (await asyncio.to_thread(path.stat)).st_size, int(data_bytes), read_s


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--per-event", type=int, default=2_000, help="events for one commit per event")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--calls", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the side-by-side comparison")
    parser.add_argument("--profile", action="store_true", help="print where a 64-appender run's time goes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        events = small_events(args.events)
        rows = raw_rows(events)
        row_bytes = sum(len(r.data) + len(r.blob) for r in map(encode, events[:100])) / 100
        print(
            f"## durable appends ({row_bytes:.0f}-byte rows, synchronous=FULL, WAL, {args.events} events;"
            f" median of {args.rounds} rounds, each round SQLite alone and the store back to back)"
        )
        rates: dict[tuple[int, str], list[float]] = {}
        runs: dict[int, list[GroupRun]] = {64: [], 512: []}
        for n in range(args.rounds):
            for appenders in (64, 512):  # side by side: SQLite alone, then the store, same rows
                tag = f"{appenders}-{n}"
                rates.setdefault((appenders, "sqlite3"), []).append(
                    raw_sqlite3(root / f"raw-{tag}.db", rows, appenders)
                )
                rates.setdefault((appenders, "aiosqlite"), []).append(
                    await raw_aiosqlite(root / f"aio-{tag}.db", rows, appenders)
                )
                run = await group_commit(root / f"group-{tag}.db", events, appenders)
                runs[appenders].append(run)
                rates.setdefault((appenders, "store"), []).append(run.rate)
                with serving_collector():  # as a started appliance runs Python's collector
                    served = await group_commit(root / f"served-{tag}.db", events, appenders)
                rates.setdefault((appenders, "served"), []).append(served.rate)
        print(
            f"{'appenders':>9} {'store':>8} {'up-gc':>8} {'sqlite3':>8} {'aiosqlite':>9}"
            "  store/sqlite3 (range)   store/aiosqlite (range)  up-gc/sqlite3 (range)  events/commit"
        )
        for appenders in (64, 512):
            store_r, served_r, sqlite3_r, aio_r = (
                rates[appenders, name] for name in ("store", "served", "sqlite3", "aiosqlite")
            )
            vs_sqlite3 = [a / b for a, b in zip(store_r, sqlite3_r, strict=True)]
            vs_aio = [a / b for a, b in zip(store_r, aio_r, strict=True)]
            served_vs = [a / b for a, b in zip(served_r, sqlite3_r, strict=True)]
            commits = statistics.median(r.commits for r in runs[appenders])
            print(
                f"{appenders:>9} {statistics.median(store_r):>8.0f} {statistics.median(served_r):>8.0f}"
                f" {statistics.median(sqlite3_r):>8.0f} {statistics.median(aio_r):>9.0f}"
                f"  {statistics.median(vs_sqlite3):>5.2f}x ({min(vs_sqlite3):.2f}-{max(vs_sqlite3):.2f})"
                f"  {statistics.median(vs_aio):>10.2f}x ({min(vs_aio):.2f}-{max(vs_aio):.2f})"
                f"  {statistics.median(served_vs):>8.2f}x ({min(served_vs):.2f}-{max(served_vs):.2f})"
                f"  {args.events / commits:>12.0f}"
            )
        print(
            "(up-gc: the store again with Python's collector as a started appliance runs it:"
            " what exists then frozen, the youngest generation collected every"
            f" {GC_YOUNG_THRESHOLD:,} allocations; appliance.operations.collector)"
        )
        print("\nwhere the store's wall time goes (median over rounds):")
        for appenders in (64, 512):
            floor = statistics.median(
                [await asyncio_alone(args.events, appenders) for _ in range(args.rounds)]
            )
            print(
                f"{appenders:>4} appenders, asyncio alone (tasks awaiting futures settled per turn):"
                f" {1e6 / floor:5.1f} us/event ({floor:.0f} events/s)"
            )
            prepare = statistics.median(r.prepare_s / r.elapsed for r in runs[appenders])
            sql = statistics.median(r.sql_s / r.elapsed for r in runs[appenders])
            per_event = statistics.median(r.elapsed / args.events * 1e6 for r in runs[appenders])
            print(
                f"{appenders:>4} appenders: {per_event:5.1f} us/event; writer thread preparing batches"
                f" (encoding, sharing, checksums) {prepare:5.1%}, in SQL (BEGIN..COMMIT) {sql:5.1%};"
                f" the rest ({1 - prepare - sql:5.1%}) the event loop alone (appenders, futures)"
            )
        same = events[: args.per_event]
        grouped = await group_commit(root / "group-same.db", same, 64)
        grouped_same, commits_same = grouped.rate, grouped.commits
        single = await commit_per_event(root / "single.db", same)
        print(
            f"\ngroup commit, 64 appenders:    {grouped_same:10.0f} events/s"
            f"  ({len(same)} events in {commits_same} commits)"
        )
        print(f"one commit per event:          {single:10.0f} events/s  ({len(same)} events)")
        print(f"ratio group / single:          {grouped_same / single:10.1f}x")
        digest_us = checksum_us(events)
        print(
            f"checksum chain: {digest_us:.2f} us/event = {digest_us * grouped_same / 1e6:.1%}"
            " of the 64-appender time per event"
        )
        start = time.perf_counter()
        report = verify_log(root / "group-64-0.db")
        verify_s = time.perf_counter() - start
        print(
            f"verify on open: {report.events / verify_s:.0f} events/s"
            f" ({report.events} events in {verify_s * 1000:.0f} ms)"
        )
        if args.profile:
            print("\n## where the time goes (64 appenders, event-loop thread, cProfile)")
            print(await asyncio.to_thread(profile_top, root / "profile.db", events, 64))

        print(
            "\n## CPU per recorded call as the conversation grows (one rollout, each call appended alone"
            " and waited for; process CPU, every thread, median of the rounds)"
        )
        print("prompt tokens   us/call")
        for length in (1_000, 2_000, 5_000, 10_000, 20_000, 30_000):
            costs = [
                await history_cost(root / f"history-{length}-{r}.db", length, 20) for r in range(args.rounds)
            ]
            print(f"{length:>13}   {statistics.median(costs):7.0f}")

        calls = conversations(args.rollouts, args.calls)
        tokens = sum(len(c.prompt_ids) + len(c.response_ids) for c in calls)
        shared_bytes, shared_json, shared_read = await stored_size(root / "shared.db", calls, share=True)
        whole_bytes, whole_json, whole_read = await stored_size(root / "whole.db", calls, share=False)
        print(
            f"\n## long rollouts ({args.rollouts} rollouts x {args.calls} calls,"
            f" {tokens / len(calls):.0f} prompt+response tokens and"
            f" {sum(len(c.request['messages']) for c in calls) / len(calls):.0f} request messages per call)"
        )
        print(
            f"stored whole:  {whole_bytes / tokens:6.2f} bytes/token  ({whole_bytes / 2**20:.1f} MiB,"
            f" JSON {whole_json / 2**20:.1f} MiB, read back in {whole_read:.2f} s)"
        )
        print(
            f"shared:        {shared_bytes / tokens:6.2f} bytes/token  ({shared_bytes / 2**20:.1f} MiB,"
            f" JSON {shared_json / 2**20:.1f} MiB, read back in {shared_read:.2f} s)"
        )
        print(
            f"ratio whole / shared: {whole_bytes / shared_bytes:6.1f}x the file,"
            f" {whole_json / shared_json:.1f}x the JSON;"
            f" reading back with sharing takes {shared_read / whole_read:.2f}x the time"
        )

        print(
            f"\n## the run's folded state (RunState) as steps consume rollouts ({args.rollouts // 2} rollouts"
            f" x {args.calls // 2} calls per step, tracemalloc)"
        )
        print("steps   state holds   the steps' calls (released)")
        for steps, held, released in state_memory(8, args.rollouts // 2, args.calls // 2):
            print(f"{steps:>5}   {held / 2**20:7.2f} MiB   {released / 2**20:7.2f} MiB")


if __name__ == "__main__":
    try:  # the event loop the appliance runs on (``lightning-appliance up``)
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
