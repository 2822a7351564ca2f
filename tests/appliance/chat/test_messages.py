"""Converting OpenAI ``messages`` arrays, and reusing a conversation's last conversion."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from appliance.chat.messages import MessageMemo, messages_from_openai, reading_conversation
from contracts.errors import BadRequest


def _call(call_id: Any, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "add 1 and 2"},
    {"role": "assistant", "content": None, "tool_calls": [_call("a", '{"a": 1, "b": 2}')]},
    {"role": "tool", "tool_call_id": "a", "content": "3"},
    {"role": "assistant", "content": [{"type": "text", "text": "3"}]},
    {"role": "developer", "content": "be brief"},
    {"role": "function", "name": "add", "content": "3"},
]


def test_repeated_messages_are_taken_from_the_memo() -> None:
    memo = MessageMemo()
    first = messages_from_openai(HISTORY, memo)
    longer = [*HISTORY, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    second = messages_from_openai([dict(m) for m in longer], memo)  # equal, not the same dicts
    assert second == messages_from_openai(longer)
    assert all(a is b for a, b in zip(first, second, strict=False))
    assert len(second) == len(longer)


def test_a_request_keeps_the_objects_of_the_messages_it_repeats() -> None:
    """A recorded call holds what it added, not another copy of its conversation: the repeated
    messages of the request become the memo's objects, except one with a number (equal to a
    boolean, so it stays the request's own)."""
    memo = MessageMemo()
    history = [*copy.deepcopy(HISTORY), {"role": "tool", "tool_call_id": 7, "content": "r"}]
    messages_from_openai(history, memo)
    longer = [*copy.deepcopy(history), {"role": "user", "content": "next"}]
    added = longer[-1]
    converted = messages_from_openai(longer, memo)
    assert converted == messages_from_openai(copy.deepcopy(longer))
    assert longer == [*history, {"role": "user", "content": "next"}]
    assert [a is b for a, b in zip(longer, history, strict=False)] == [True] * len(HISTORY) + [False]
    assert longer[-1] is added


def test_numbers_and_booleans_are_converted_every_time() -> None:
    """``1 == True``: a message holding a number or a boolean is never taken from the memo."""
    memo = MessageMemo()
    ones = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [_call(1, {"x": 1})]},
        {"role": "tool", "tool_call_id": 1, "content": "r"},
    ]
    trues = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [_call(True, {"x": True})]},
        {"role": "tool", "tool_call_id": True, "content": "r"},
    ]
    assert ones == trues
    assert messages_from_openai(ones, memo) == messages_from_openai(ones)
    converted = messages_from_openai(trues, memo)
    assert converted == messages_from_openai(trues)
    assert converted[1].tool_calls[0].arguments == '{"x": true}'
    assert converted[2].tool_call_id == "True"


def test_an_edited_or_shorter_history_is_read_again() -> None:
    memo = MessageMemo()
    messages_from_openai(HISTORY, memo)
    edited = [*HISTORY[:3], {"role": "tool", "tool_call_id": "a", "content": "4"}, *HISTORY[4:]]
    assert messages_from_openai(edited, memo)[3].content == "4"
    assert messages_from_openai(HISTORY[:2], memo) == messages_from_openai(HISTORY[:2])
    assert messages_from_openai(HISTORY, memo) == messages_from_openai(HISTORY)


def test_a_bad_message_is_refused_and_leaves_the_memo_as_it_was() -> None:
    memo = MessageMemo()
    first = messages_from_openai(HISTORY, memo)
    with pytest.raises(BadRequest) as refused:
        messages_from_openai([*HISTORY, {"role": "robot", "content": "x"}], memo)
    assert refused.value.param == "messages[7]"
    again = messages_from_openai([*HISTORY, {"role": "user", "content": "x"}], memo)
    assert all(a is b for a, b in zip(first, again, strict=False))


def test_reading_conversation_sets_the_memo_for_the_block_only() -> None:
    memo = MessageMemo()
    with reading_conversation(memo):
        first = messages_from_openai(HISTORY)
    assert memo.messages == first
    assert messages_from_openai(HISTORY)[0] is not first[0]  # outside the block: no memo
    with reading_conversation(memo):
        assert messages_from_openai(HISTORY)[0] is first[0]


def _message(spec: tuple[int, str, Any]) -> dict[str, Any]:
    kind, text, value = spec
    if kind == 0:
        return {"role": text, "content": text}
    if kind == 1:
        return {"role": "tool", "content": text, "tool_call_id": value}
    if kind == 2:
        return {"role": "assistant", "content": None, "tool_calls": [_call(value, {"v": value})]}
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


EQUAL = (1, 1.0, True)


def _spec(rng: random.Random) -> tuple[int, str, Any]:
    return rng.randrange(4), rng.choice(["user", "system", "developer"]), rng.choice([*EQUAL, "a", None])


def test_the_memo_converts_as_reading_afresh_whatever_is_sent() -> None:
    """Longer, shorter and edited histories, and values re-sent as equal ones of another type
    (1, 1.0, true): each conversion with the memo is the one without it."""
    rng = random.Random(7)
    memo = MessageMemo()
    history = [_spec(rng)]
    for _ in range(500):
        step = rng.randrange(6)
        if step <= 1:
            history = history + [_spec(rng) for _ in range(rng.randrange(1, 3))]
        elif step == 2 and len(history) > 1:
            history = history[: rng.randrange(1, len(history))]
        elif step == 3:
            at = rng.randrange(len(history))
            history = [*history[:at], _spec(rng), *history[at + 1 :]]
        else:
            history = [(k, t, rng.choice(EQUAL) if v in EQUAL else v) for k, t, v in history]
        sent = [_message(spec) for spec in history]
        assert messages_from_openai(sent, memo) == messages_from_openai(sent)
