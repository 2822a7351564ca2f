"""Request sharing: a call's conversation stored as the messages after its rollout's previous call's."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.errors import StoreError
from store import EventStore, LLMCallCompleted
from store.codec import REQUEST_REF, decode, encode, share_request, shared_ref
from store.eventstore import read_events_sync, read_last_sync, verify_log
from store.tokens import Tokens

REPO = Path(__file__).resolve().parents[2]
TURNS = 50


def call(
    rollout: str, n: int, request: dict[str, Any], prompt: tuple[int, ...] = (1, 2, 3)
) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=float(n),
        rollout=rollout,
        call_id=f"{rollout}-{n}",
        surface="openai.chat",
        prompt_ids=Tokens(prompt),
        response_ids=Tokens((4, 5)),
        response_logprobs=(-0.5, -0.25),
        policy_version=0,
        finish_reason="stop",
        request=request,
        response_text="ok",
        queue_s=0.0,
        total_s=0.5,
    )


def chat(rollout: str, turns: int, *, key: str = "messages") -> list[LLMCallCompleted]:
    """A conversation in which every request repeats all earlier messages and adds two."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 10}]
    out = []
    for n in range(turns):
        messages.append({"role": "user", "content": f"turn {n}: " + "question é " * 20})
        out.append(call(rollout, n, {"model": "m", key: list(messages), "temperature": 0.5}))
        messages.append({"role": "assistant", "content": f"answer {n} " * 15, "tool_calls": None})
    return out


def json_bytes(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT SUM(LENGTH(CAST(data AS BLOB))) FROM events").fetchone()[0])


async def test_a_growing_conversation_stores_bytes_linear_in_its_turns(tmp_path: Path) -> None:
    calls = chat("a", TURNS)
    last_whole = len(encode(calls[-1]).data.encode())  # the last turn's request alone, stored whole
    shared, whole = tmp_path / "shared.db", tmp_path / "whole.db"
    for path, share in ((shared, True), (whole, False)):
        async with await EventStore.open(path, share_prefixes=share) as store:
            for event in calls:
                await store.append([event])
    assert json_bytes(shared) < 3 * last_whole
    assert json_bytes(whole) > 10 * last_whole  # what the bound rules out: O(turns^2)
    assert [s.event for s in read_events_sync(shared)] == calls


async def test_shared_requests_read_back_identical_across_reopen_and_readers(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    conversations = [chat("a", 12), chat("b", 12, key="input")]
    calls = [c[n] for n in range(12) for c in conversations]
    async with await EventStore.open(path) as store:
        await store.append(calls[:10])
        await store.append(calls[10:14])
    async with await EventStore.open(path) as store:  # a fresh writer: the first calls go whole
        for i in range(14, len(calls), 3):
            await store.append(calls[i : i + 3])
        assert [s.event for s in await store.read()] == calls
        assert [s.event for s in await store.read(rollout="b")] == conversations[1]
    assert verify_log(path).events == len(calls)
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT type, data, blob FROM events ORDER BY position").fetchall()
    refs = [shared_ref(t, d, b) for t, d, b in rows]
    assert [r is None for r in refs].count(True) == 4  # each rollout's first call, twice
    async with await EventStore.open(path, readonly=True) as reader:  # an empty cache
        assert [s.event for s in await reader.read(after=len(calls) - 1)] == calls[-1:]
        assert [s.event for s in await reader.read()] == calls
    assert read_last_sync(path, ["LLMCallCompleted"]) == read_events_sync(path)[-1]
    program = (
        "import sys; from pathlib import Path; from store.eventstore import read_events_sync;"
        " print(repr([s.event for s in read_events_sync(Path(sys.argv[1]))]))"
    )
    args = [sys.executable, "-c", program, str(path)]
    other = await asyncio.to_thread(
        subprocess.run, args, cwd=REPO, capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == repr(calls)


async def test_a_rewritten_history_shares_only_the_messages_still_in_common(tmp_path: Path) -> None:
    first, second, third = chat("a", 3)
    messages = second.request["messages"]
    rewritten = call(
        "a", 9, {**third.request, "messages": [*messages[:2], {"role": "user", "content": "new"}]}
    )
    path = tmp_path / "events.db"
    async with await EventStore.open(path) as store:
        await store.append([first, second, rewritten, third])
    with sqlite3.connect(path) as db:
        data = [d for (d,) in db.execute("SELECT data FROM events ORDER BY position")]
    assert [d.startswith('{"' + REQUEST_REF) for d in data] == [False, True, True, True]
    assert [s.event for s in read_events_sync(path)] == [first, second, rewritten, third]


def test_requests_without_a_shared_conversation_are_stored_whole() -> None:
    first, second = chat("a", 2)
    for earlier, later in (
        ({"model": "m"}, second.request),
        (first.request, {"model": "m", "messages": "not a list"}),
        ({"messages": [{"role": "user", "content": "other"}]}, second.request),
    ):
        event = call("a", 1, later)
        assert share_request(encode(event), event, 1, earlier) == encode(event)


def test_decode_without_the_earlier_request_fails() -> None:
    first, second = chat("a", 2)
    row = share_request(encode(second), second, 1, first.request)
    assert shared_ref(row.type, row.data, row.blob) == 1
    assert len(row.data) < len(encode(second).data)
    with pytest.raises(StoreError, match="shares"):
        decode(row.type, row.version, row.ts, row.data, row.blob)
    assert decode(row.type, row.version, row.ts, row.data, row.blob, request=first.request) == second


message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=8)}
)


@given(
    earlier=st.lists(message, max_size=6),
    later=st.lists(message, max_size=6),
    key=st.sampled_from(["messages", "input"]),
)
def test_share_request_round_trips_any_conversation(
    earlier: list[dict[str, Any]], later: list[dict[str, Any]], key: str
) -> None:
    event = call("a", 1, {key: earlier + later, "n": 1.5})
    row = share_request(encode(event), event, 7, {key: earlier})
    request = {key: earlier} if shared_ref(row.type, row.data, row.blob) == 7 else None
    assert decode(row.type, row.version, row.ts, row.data, row.blob, request=request) == event
