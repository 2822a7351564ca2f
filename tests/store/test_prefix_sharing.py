"""Prefix sharing: calls stored as (earlier call, shared length, suffix) read back identical."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.errors import StoreCorrupted, StoreError
from store import EventStore, LLMCallCompleted, RolloutFinished, StoredEvent, reading
from store.codec import (
    decode,
    encode,
    encode_shared,
    prefix_source,
    share_prefix,
    share_request,
    shared_prefix_ref,
)
from store.eventstore import iter_events_sync, read_calls_sync, read_events_sync, verify_log
from store.tokens import Tokens


def call(rollout: str, n: int, prompt: Sequence[int], response: Sequence[int]) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=float(n),
        rollout=rollout,
        call_id=f"{rollout}-{n}",
        surface="openai.chat",
        prompt_ids=Tokens(prompt),
        response_ids=Tokens(response),
        response_logprobs=tuple(-0.5 for _ in response),
        policy_version=0,
        finish_reason="stop",
        request={"model": "m"},
        response_text="x",
        queue_s=0.0,
        total_s=0.5,
    )


def conversation(rollout: str, calls: int, seed: int) -> list[LLMCallCompleted]:
    """Each prompt = previous prompt + response + a new user turn; every third call breaks the prefix."""
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(50_000) for _ in range(40))
    out: list[LLMCallCompleted] = []
    for n in range(calls):
        response = tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 30)))
        out.append(call(rollout, n, prompt, response))
        prompt = prompt + response + tuple(rng.randrange(50_000) for _ in range(12))
        if n % 3 == 2:  # the harness rewrote history after token 20
            prompt = (*prompt[:20], 1, 2, 3, *prompt[20:])
    return out


def interleaved(rollouts: int, calls: int) -> list[LLMCallCompleted]:
    convs = [conversation(f"r{i}", calls, seed=i) for i in range(rollouts)]
    return [c[n] for n in range(calls) for c in convs]


def blob_bytes(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT SUM(LENGTH(blob)) FROM events").fetchone()[0])


async def test_shared_calls_read_back_identical_through_every_reader(tmp_path: Path) -> None:
    events = interleaved(rollouts=3, calls=8)
    shared, whole = tmp_path / "shared.db", tmp_path / "whole.db"
    async with await EventStore.open(whole, share_prefixes=False) as store:
        await store.append(events)
    async with await EventStore.open(shared) as store:
        for i in range(0, len(events), 5):  # over several commits
            await store.append(events[i : i + 5])
        assert [s.event for s in await store.read()] == events
        assert [s.event for s in await store.read(rollout="r1")] == [e for e in events if e.rollout == "r1"]
        assert [s.event for s in await store.read(after=20, limit=3)] == events[20:23]
        followed: list[StoredEvent] = []
        async for stored in store.subscribe(after=10):
            followed.append(stored)
            if stored.position == len(events):
                break
        assert [s.event for s in followed] == events[10:]
    assert [s.event for s in read_events_sync(shared)] == events
    assert [s.event for s in read_events_sync(shared, after=len(events) - 1)] == events[-1:]
    assert [s.event for s in read_events_sync(shared, after=4, limit=7)] == events[4:11]
    for page in (1, 4, len(events)):  # folded a page at a time (a start, status, a backup)
        assert [s.event for s in iter_events_sync(shared, page=page)] == events
    assert [s.event for s in iter_events_sync(shared, after=9, page=4)] == events[9:]
    assert read_calls_sync(shared, "r2") == [e for e in events if e.rollout == "r2"]
    # A fresh reader (empty cache) resolves a late call through its rollout's earlier calls.
    async with await EventStore.open(shared, readonly=True) as reader:
        assert [s.event for s in await reader.read(after=len(events) - 1)] == events[-1:]
    assert verify_log(shared).events == len(events)
    assert blob_bytes(shared) < blob_bytes(whole) / 2
    with sqlite3.connect(shared) as db:
        refs = [shared_prefix_ref(t, b) for t, b in db.execute("SELECT type, blob FROM events")]
    assert sum(r is not None for r in refs) == len(events) - 3  # all but each rollout's first call


async def test_sharing_restarts_after_reopen_and_stops_at_rollout_end(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    calls = conversation("a", 4, seed=1)
    async with await EventStore.open(path) as store:
        await store.append(calls[:2])
    async with await EventStore.open(path) as store:  # the writer forgot the last call: stored whole
        await store.append([calls[2]])
        await store.append([calls[3], RolloutFinished(ts=0.0, rollout="a", status="finished")])
        late = call("a", 9, calls[3].prompt_ids + calls[3].response_ids, (5,))
        await store.append([late])
        assert [s.event for s in await store.read()][-1] == late
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT position, type, blob FROM events ORDER BY position").fetchall()
    assert [shared_prefix_ref(t, b) for _, t, b in rows] == [None, 1, None, 3, None, None]


async def test_a_reference_to_a_missing_call_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    calls = conversation("a", 2, seed=2)
    async with await EventStore.open(path) as store:
        await store.append(calls)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE events SET rollout = 'other' WHERE position = 1")
    with pytest.raises(StoreCorrupted, match="shares tokens with a call at 1"):
        read_events_sync(path, after=1)


def test_decode_without_the_earlier_call_fails() -> None:
    first, second = conversation("a", 2, seed=3)
    row = share_prefix(encode(second), second, 1, prefix_source(first) or Tokens())
    assert shared_prefix_ref(row.type, row.blob) == 1
    with pytest.raises(StoreError, match="shares"):
        decode(row.type, row.version, row.ts, row.data, row.blob)


tokens = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=60).map(tuple)


@given(prompt=tokens, response=tokens, source=tokens)
def test_share_prefix_round_trips_any_prompt(
    prompt: tuple[int, ...], response: tuple[int, ...], source: tuple[int, ...]
) -> None:
    event = call("a", 1, prompt, response)
    row = share_prefix(encode(event), event, 7, Tokens(source))
    prefix = Tokens(source) if shared_prefix_ref(row.type, row.blob) == 7 else None
    assert decode(row.type, row.version, row.ts, row.data, row.blob, prefix) == event
    assert len(row.blob) <= len(encode(event).blob)


messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=5)}),
    max_size=6,
)


@given(
    earlier_prompt=tokens,
    earlier_response=tokens,
    new=tokens,
    cut=st.integers(0, 130),
    before=messages,
    after=messages,
    key=st.sampled_from(["messages", "input"]),
)
def test_encode_shared_is_encode_then_share(
    earlier_prompt: tuple[int, ...],
    earlier_response: tuple[int, ...],
    new: tuple[int, ...],
    cut: int,
    before: list[dict[str, str]],
    after: list[dict[str, str]],
    key: str,
) -> None:
    """The writer's one-step encoding is byte for byte the whole row shared in two steps."""
    earlier = call("a", 1, earlier_prompt, earlier_response)
    earlier = dataclasses.replace(earlier, request={"model": "m", key: before})
    prompt = (earlier_prompt + earlier_response)[:cut] + new
    event = dataclasses.replace(call("a", 2, prompt, (5, 6)), request={"model": "m", key: before + after})
    expected = share_request(
        share_prefix(encode(event), event, 7, prefix_source(earlier) or Tokens()), event, 7, earlier.request
    )
    assert encode_shared(event, 7, earlier) == expected


async def test_reads_stay_exact_when_the_token_cache_is_tiny(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "events.db"
    events = interleaved(rollouts=4, calls=6)
    async with await EventStore.open(path) as store:
        await store.append(events)
    monkeypatch.setattr(reading, "_DECODED_TOKENS", 50)  # evicts all but the newest call
    async with await EventStore.open(path, readonly=True) as reader:
        assert [s.event for s in await reader.read(limit=7)] == events[:7]
        assert [s.event for s in await reader.read(after=7)] == events[7:]
        assert [s.event for s in await reader.read(rollout="r2")] == [e for e in events if e.rollout == "r2"]
        assert [s.event for s in await reader.read(after=len(events) - 1)] == events[-1:]
