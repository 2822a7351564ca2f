"""Request bodies as the proxy reads them, and server-sent events as it writes them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.proxy.http import MAX_NESTING, SLOT, JsonSlot, dumps, parse_body, sse_events
from contracts.errors import BadRequest


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": "héllo \U0001f600"}], "temperature": 0.7},
        {"seed": 2**63 - 1, "max_tokens": 2**64 + 1, "n": -(2**70), "x": [1.5, -0.0, 1e300, None, True]},
        {"digits": "12345678901234567890 in a string reads the same", "big": 10**30},
        {"messages": [{"role": "user", "content": [{"n": -(2**63) - 1}, {"f": 1.8e19}, {"n": 2**64 - 1}]}]},
    ],
)
def test_a_body_reads_as_pythons_json_reads_it(body: dict[str, Any]) -> None:
    """Every number stays what Python's json reads: integers beyond 64 bits too (orjson would
    read them as floats, so such a body is read again the slow way)."""
    raw = json.dumps(body, ensure_ascii=False).encode()
    parsed = parse_body(raw)
    assert parsed == json.loads(raw)
    assert [type(v) for v in parsed.values()] == [type(v) for v in json.loads(raw).values()]


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b'{"temperature": NaN}', None),  # read (Python's json reads NaN); the field's check refuses it
        (b'{"a": "\\ud800"}', "surrogate"),
        (b"[1]", "JSON object"),
        (b"{", "not valid JSON"),
        (b'{"a": ' + b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1) + b"}", "deeper"),
        (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper"),
        # A float orjson may have made of a large integer sends the body to Python's json, which
        # still judges its depth.
        (b'{"f": 1e19, "a": ' + b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1) + b"}", "deeper"),
    ],
)
def test_what_orjson_refuses_is_judged_as_before(raw: bytes, said: str | None) -> None:
    if said is None:
        assert parse_body(raw)["temperature"] != parse_body(raw)["temperature"]  # NaN
        return
    with pytest.raises(BadRequest) as caught:
        parse_body(raw)
    assert said in caught.value.message


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
