"""Request bodies as the proxy reads them: whole (orjson, and Python's json where the two would
differ), and a conversation's next body from where its last one ended, which reads the same."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.chat.transcript import BodyHead
from appliance.proxy import bodies
from appliance.proxy.bodies import MAX_NESTING, parse_body, read_conversation
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


# --- a conversation's next body ------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _every_body_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bodies here are short: each is read from its head all the same."""
    monkeypatch.setattr(bodies, "SMALL_BODY", 0)


#: How a client may write its bodies: Python's json as most SDKs call it, compact, indented, raw
#: UTF-8.
STYLES: tuple[dict[str, Any], ...] = (
    {},
    {"separators": (",", ":")},
    {"indent": 2},
    {"ensure_ascii": False},
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=8)
    | st.sampled_from(['"]},[{', "\\", "\U0001f600", "messages", '"model":']),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
new_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": json_values}),
    min_size=1,
    max_size=3,
)
#: What a conversation does from one body to the next: add messages (the usual), send the same
#: again, edit an earlier one, take another style, or come through another surface (its array
#: named otherwise).
steps = st.lists(
    st.one_of(
        new_messages.map(lambda added: ("add", added)),
        st.just(("same", None)),
        st.tuples(st.just("edit"), json_values),
        st.tuples(st.just("style"), st.integers(0, len(STYLES) - 1)),
        st.tuples(st.just("key"), st.sampled_from(["messages", "input"])),
    ),
    min_size=1,
    max_size=8,
)


def read(raw: bytes, head: BodyHead | None = None, key: str = "messages") -> Any:
    """What the body reads as (``read_conversation`` with ``head`` for the array ``key``, else
    ``parse_body``): the object and its keys in order, or the error's message; NaN written out so
    it compares."""
    try:
        body = parse_body(raw) if head is None else read_conversation(raw, head, key)
    except BadRequest as exc:
        return ("error", exc.message)
    return json.dumps(body, default=str), list(body)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=steps,
    before=st.dictionaries(st.sampled_from(["model", "tools", "stop"]), json_values, max_size=2),
    after=st.dictionaries(st.sampled_from(["max_tokens", "tools", "model", "n"]), json_values, max_size=2),
    style=st.integers(0, len(STYLES) - 1),
)
def test_a_conversations_bodies_read_as_each_reads_whole(
    steps: list[tuple[str, Any]], before: dict[str, Any], after: dict[str, Any], style: int
) -> None:
    head = BodyHead()
    key = "messages"
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    for step, value in steps:
        if step == "add":
            messages = [*messages, *value]
        elif step == "edit":
            messages = [{"role": "user", "content": value}, *messages[1:]]
        elif step == "style":
            style = value
        elif step == "key":
            key = value
        body = {**before, key: messages, **after}
        raw = json.dumps(body, **STYLES[style]).encode()
        known = head.messages if head.raw and head.key == key and raw.startswith(head.raw) else []
        assert read(raw, head, key) == read(raw)
        # Where the body repeats the head's bytes, those messages were not read again.
        assert all(a is b for a, b in zip(head.messages, known, strict=False))
        assert not known or head.messages[: len(known)] == known
        if head.raw:  # the head: where the last message ends
            keys = list(body)
            upto = {name: body[name] for name in keys[: keys.index(key) + 1]}
            assert raw.startswith(head.raw) and head.key == key
            assert json.loads(head.raw + b"]}") == upto == {**upto, key: head.messages}


def test_a_growing_conversation_is_read_from_where_its_last_body_ended(whole_reads: list[bytes]) -> None:
    whole = whole_reads
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"required": ["x"]}}}]
    for style in STYLES:
        head = BodyHead()
        whole.clear()
        messages: list[Any] = [{"role": "system", "content": "s"}]
        last: list[Any] = []
        for turn in range(6):
            messages = [*messages, {"role": "user", "content": f"turn {turn} \U0001f600 ]}}"}]
            raw = json.dumps({"messages": messages, "model": "m", "tools": tools}, **style).encode()
            body = read_conversation(raw, head)
            assert body == json.loads(raw) and list(body) == ["messages", "model", "tools"]
            # The messages it repeats are the objects read last time: not read again.
            assert all(a is b for a, b in zip(body["messages"], last, strict=False))
            last = body["messages"]
            messages = [*messages, {"role": "assistant", "content": f"answer {turn}"}]
        assert len(whole) == 1, style  # the first body alone was read whole

    # An earlier message edited: that body is read whole, and the next continues from it.
    head = BodyHead()
    whole.clear()
    edited = [{"role": "user", "content": "b"}]
    for messages in ([{"role": "user", "content": "a"}], edited, [*edited, {"role": "user", "content": "c"}]):
        read_conversation(json.dumps({"model": "m", "messages": messages}).encode(), head)
    assert [json.loads(raw)["messages"][0]["content"] for raw in whole] == ["a", "b"]


@pytest.mark.parametrize(
    "tail",
    [
        b", ]}",  # a trailing comma in the array
        b"],}",  # and in the object
        b"]}x",  # something after the object
        b"]",  # the object never closed
        b', {"role": "user", "content": "\\ud800"}]}',  # a lone surrogate
        b', {"role": "user", "content": "\\ud83d\\ude00"}]}',  # a pair: one character
        b', {"content": ' + b"[" * MAX_NESTING + b"]" * MAX_NESTING + b"}]}",  # too deep
        b', {"content": NaN}]}',  # Python's json reads it
        b', {"content": 1e400}]}',
        b', {"content": ' + b"9" * 5000 + b"}]}",  # a number Python will not read
        b'], "messages": [{"role": "user", "content": "again"}]}',  # the array given twice
        b', {"role": "user", "content": "\xff"}]}',  # not UTF-8
        b", " + json.dumps({"role": "user", "content": "é"}, ensure_ascii=False).encode() + b"]}",
    ],
)
def test_what_follows_the_head_reads_as_the_whole_body_reads(tail: bytes) -> None:
    head = BodyHead()
    first = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    read_conversation(first, head)
    assert head.raw == b'{"model": "m", "messages": [{"role": "user", "content": "hi"}'
    raw = head.raw + tail
    assert read(raw, head) == read(raw)


def test_a_short_body_is_read_whole_and_leaves_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bodies, "SMALL_BODY", 100)
    head = BodyHead()
    short = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert read_conversation(short, head) == json.loads(short) and head.raw == b""
    long = json.dumps({"messages": [{"role": "user", "content": "x" * 100}], "model": "m"}).encode()
    read_conversation(long, head)
    assert head.raw == long[: long.index(b"]")]
    assert read_conversation(short, head) == json.loads(short) and head.raw == long[: long.index(b"]")]
