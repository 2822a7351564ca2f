"""Subscribers that keep up get new events from the writer's recent commits, not from the log:
the events must be exactly those the log gives back (float32 log-probabilities, shared requests)."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from contracts.errors import StoreError
from store import EventStore, LLMCallCompleted, RewardReported, RolloutFinished, StoredEvent, eventstore
from store.codec import as_stored, decode, encode, encode_shared, prefix_source
from store.tokens import Tokens


def call(rollout: str, n: int, prompt: Sequence[int], messages: list[dict[str, str]]) -> LLMCallCompleted:
    response = tuple(range(n, n + 5))
    return LLMCallCompleted(
        ts=float(n),
        rollout=rollout,
        call_id=f"{rollout}-{n}",
        surface="openai.chat",
        prompt_ids=Tokens(prompt),
        response_ids=Tokens(response),
        response_logprobs=tuple(-0.1 * (i + 1) for i in range(len(response))),  # not float32-exact
        policy_version=0,
        finish_reason="stop",
        request={"model": "m", "messages": messages},
        response_text="x",
        sampling={"temperature": 1.0, "stop": ["\n"]},
        queue_s=0.001,
        total_s=0.01,
    )


def conversation(rollout: str, calls: int, seed: int) -> list[LLMCallCompleted]:
    rng = random.Random(seed)
    prompt = Tokens(rng.randrange(50_000) for _ in range(30))
    messages = [{"role": "user", "content": "hello"}]
    out = []
    for n in range(calls):
        event = call(rollout, n, prompt, list(messages))
        out.append(event)
        prompt = prompt + event.response_ids + Tokens(rng.randrange(50_000) for _ in range(7))
        messages += [{"role": "assistant", "content": f"a{n}"}, {"role": "user", "content": f"u{n}"}]
    return out


async def follow(store: EventStore, after: int, last: int) -> list[StoredEvent]:
    seen: list[StoredEvent] = []
    async for stored in store.subscribe(after=after):
        seen.append(stored)
        if stored.position == last:
            break
    return seen


class CountingReads:
    """Counts the store's reads of the log (what a subscriber falls back on)."""

    def __init__(self, store: EventStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        read = store.read

        async def counted(*args: Any, **kwargs: Any) -> list[StoredEvent]:
            self.calls += 1
            return await read(*args, **kwargs)

        monkeypatch.setattr(store, "read", counted)


async def test_live_subscribers_get_exactly_what_the_log_gives_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[LLMCallCompleted | RewardReported | RolloutFinished] = []
    for n, calls in enumerate(zip(*(conversation(f"r{i}", 6, seed=i) for i in range(3)), strict=True)):
        events += calls
        events.append(RewardReported(ts=float(n), rollout="r0", reward=0.5, source="agent"))
    events.append(RolloutFinished(ts=9.0, rollout="r1", status="finished"))
    async with await EventStore.open(tmp_path / "events.db") as store:
        reads = CountingReads(store, monkeypatch)
        follower = asyncio.create_task(follow(store, 0, len(events)))
        await asyncio.sleep(0.05)  # the follower has read the (empty) log and waits
        for i in range(0, len(events), 4):  # several commits while the follower waits
            await store.append(events[i : i + 4])
        live = await asyncio.wait_for(follower, 10)
        assert reads.calls == 1  # every new event came from the recent commits
        logged = await store.read()
    assert live == logged
    first = live[0].event
    assert isinstance(first, LLMCallCompleted) and isinstance(events[0], LLMCallCompleted)
    # The log holds float32 log-probabilities: so does what the live subscriber got.
    assert first.response_logprobs != events[0].response_logprobs
    assert first.response_logprobs == pytest.approx(events[0].response_logprobs)


async def test_a_subscriber_behind_the_recent_commits_reads_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eventstore, "_RECENT_EVENTS", 5)
    events = conversation("r", 40, seed=1)
    async with await EventStore.open(tmp_path / "events.db") as store:
        for event in events:
            await store.append([event])
        reads = CountingReads(store, monkeypatch)
        behind = await follow(store, 3, len(events))
        assert reads.calls >= 1
        reads.calls = 0
        caught_up = await follow(store, 36, len(events))  # held in memory: 36..40
        assert reads.calls == 0
        logged = await store.read()
    assert behind == logged[3:]
    assert caught_up == logged[36:]


async def test_every_page_of_the_recent_commits_is_the_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pages are taken from either end of the recent commits: from every starting point, a page
    # (here of 3) must be the log's, whichever end it was walked from.
    monkeypatch.setattr(eventstore, "_RECENT_EVENTS", 10)
    monkeypatch.setattr(eventstore, "_PAGE", 3)
    events = conversation("r", 16, seed=3)
    async with await EventStore.open(tmp_path / "events.db") as store:
        for i in range(0, len(events), 2):
            await store.append(events[i : i + 2])
        logged = await store.read()
        assert store._recently_committed(5) is None  # positions 7..16 are held
        for after in range(6, 17):
            page = store._recently_committed(after)
            assert page == logged[after : after + 3], after


async def test_recent_commits_are_bounded_by_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventstore, "_RECENT_TOKENS", 200)
    events = conversation("r", 10, seed=2)  # prompts of 30, 42, 54, ... tokens
    async with await EventStore.open(tmp_path / "events.db") as store:
        await store.append(events)
        reads = CountingReads(store, monkeypatch)
        assert [s.position for s in await follow(store, 8, 10)] == [9, 10]  # 138 + 150 tokens > 200
        assert reads.calls == 1
        reads.calls = 0
        assert [s.event for s in await follow(store, 9, 10)] == [s.event for s in await store.read(after=9)]
        assert reads.calls == 1  # only the comparison's own read


tokens = st.lists(st.integers(0, 2**31 - 1), max_size=40).map(tuple)
messages = st.lists(
    st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=4)}), max_size=5
)


@given(earlier_prompt=tokens, new=tokens, cut=st.integers(0, 50), before=messages, after=messages)
def test_as_stored_is_decode(
    earlier_prompt: tuple[int, ...],
    new: tuple[int, ...],
    cut: int,
    before: list[dict[str, str]],
    after: list[dict[str, str]],
) -> None:
    earlier = call("a", 1, earlier_prompt, before)
    event = call("a", 2, (earlier_prompt + earlier.response_ids)[:cut] + new, before + after)
    row = encode_shared(event, 7, earlier)
    expected = decode(
        row.type, row.version, row.ts, row.data, row.blob, prefix_source(earlier), earlier.request
    )
    assert as_stored(event, row) == expected
    whole = encode(event)
    assert as_stored(event, whole) == decode(whole.type, whole.version, whole.ts, whole.data, whole.blob)
    reward = RewardReported(ts=1.0, rollout="a", reward=float(cut), source="agent")
    assert as_stored(reward, encode(reward)) == reward


def same(a: Any, b: Any) -> bool:
    """``a == b`` with the same types throughout (a tuple is not a list, 1 is not 1.0 nor True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, LLMCallCompleted):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, float) and a != a:
        return bool(b != b)
    return bool(a == b)


# What a harness's request or an engine's figures may hold: JSON's values, and what JSON would
# give back otherwise (tuples, non-finite floats, integers past 64 bits, keys that are not strings).
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=3)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=2) | st.integers(0, 3), inner, max_size=3)
    ),
    max_leaves=8,
)
float32_exact = st.floats(-50, 0, width=32)


@example(
    extra={"x": [math.nan]}, sampling={}, turns=[], logprobs=[-0.5] * 5, inexact=False, cut=1, shared=True
)
@example(
    extra=[(1, 2)],
    sampling={"t": 2**70},
    turns=[{"a": [-math.inf]}],
    logprobs=[-0.5] * 5,
    inexact=False,
    cut=0,
    shared=False,
)
@given(
    extra=values,
    sampling=values,
    turns=st.lists(values, max_size=2),
    logprobs=st.lists(float32_exact, min_size=5, max_size=5),
    inexact=st.booleans(),
    cut=st.integers(0, 3),
    shared=st.booleans(),
)
def test_as_stored_is_decode_value_for_value_and_type_for_type(
    extra: Any, sampling: Any, turns: list[Any], logprobs: list[float], inexact: bool, cut: int, shared: bool
) -> None:
    before = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    earlier = call("a", 1, tuple(range(30)), before)
    messages = [*before[:cut], {"role": "user", "content": "more", "extra": extra}]
    event = replace(
        call("a", 2, earlier.prompt_ids + earlier.response_ids + (7, 8), messages),
        request={"model": "m", "messages": messages, "extra": extra},
        sampling=sampling if isinstance(sampling, dict) else {"value": sampling},
        assistant_turns=tuple(turns),
        response_logprobs=(-0.1, *logprobs[1:]) if inexact else tuple(logprobs),  # -0.1: not float32's
    )
    try:
        row = encode_shared(event, 7, earlier) if shared else encode(event)
    except StoreError:
        return  # not storable (a key JSON cannot tell from another once written)
    expected = decode(
        row.type, row.version, row.ts, row.data, row.blob, prefix_source(earlier), earlier.request
    )
    got = as_stored(event, row)
    assert isinstance(got, LLMCallCompleted) and isinstance(expected, LLMCallCompleted)
    assert got == expected
    # The shared messages are the event's own (equal to the earlier call's), the rest as read.
    assert same(without_shared(got, cut), without_shared(expected, cut))


def without_shared(event: LLMCallCompleted, shared: int) -> LLMCallCompleted:
    return replace(event, request={**event.request, "messages": event.request["messages"][shared:]})


def test_a_call_as_the_proxy_records_it_is_its_own_stored_event() -> None:
    # JSON's own values and float32 log-probabilities (an engine's): nothing to read back.
    earlier = call("a", 1, tuple(range(30)), [{"role": "user", "content": "hello"}])
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "more"},
    ]
    event = replace(
        call("a", 2, (*earlier.prompt_ids, *earlier.response_ids, 7), messages),
        response_logprobs=(-0.5, -0.25, -1.0, -0.125, -2.0),
    )
    for row in (encode(event), encode_shared(event, 7, earlier)):
        assert as_stored(event, row) is event
    # A log-probability float32 would change is read as the log has it.
    rounded = replace(event, response_logprobs=(-0.1, -0.25, -1.0, -0.125, -2.0))
    got = as_stored(rounded, encode(rounded))
    assert isinstance(got, LLMCallCompleted) and got is not rounded
    assert got.response_logprobs[0] == pytest.approx(-0.1) and got.response_logprobs[0] != -0.1
    # A tuple field given as a list (against its type) is read back as the tuple the log holds.
    listed = replace(event, assistant_turns=[{"index": 1}])  # type: ignore[arg-type]
    got = as_stored(listed, encode(listed))
    assert isinstance(got, LLMCallCompleted) and same(got.assistant_turns, ({"index": 1},))
