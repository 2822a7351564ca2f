"""Server-sent events as the proxy writes them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.proxy.http import SLOT, JsonSlot, dumps, sse_events


def test_sse_events_are_written_in_one_piece() -> None:
    written = sse_events([(None, {"a": "é", "b": [1, 2]}), ("done", "[DONE]"), (None, {"n": 2**70})])
    assert (
        written
        == (
            'data: {"a":"é","b":[1,2]}\n\nevent: done\ndata: [DONE]\n\ndata: {"n":1180591620717411303424}\n\n'
        ).encode()
    )


def test_sse_events_take_json_already_written() -> None:
    assert sse_events([(None, b'{"a":1}')]) == b'data: {"a":1}\n\n'
    assert sse_events([(None, {"a": 1})]) == b'data: {"a":1}\n\n'
    assert sse_events([("x", b"[1]"), (None, b"2")]) == b"event: x\ndata: [1]\n\ndata: 2\n\n"


@given(st.text())
def test_a_json_slot_writes_what_dumps_writes(value: str) -> None:
    chunk = {
        "id": "c-1",
        "choices": [{"index": 0, "delta": {"content": SLOT}, "finish_reason": None}],
        "u": None,
    }
    slot = JsonSlot.of(chunk)
    assert slot is not None
    chunk["choices"][0]["delta"]["content"] = value  # type: ignore[index]
    try:
        expected = dumps(chunk)
    except UnicodeEncodeError:  # a lone surrogate: neither writes it
        with pytest.raises(UnicodeEncodeError):
            slot.fill(value)
        return
    assert slot.fill(value) == expected


def test_a_json_slot_needs_its_marker_once_and_orjson() -> None:
    assert JsonSlot.of({"a": "x"}) is None
    assert JsonSlot.of({"a": SLOT, "b": SLOT}) is None
    assert JsonSlot.of({"a": SLOT, "n": 2**70}) is None  # Python's json would write it
