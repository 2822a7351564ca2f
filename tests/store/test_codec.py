"""Codec: every event type round-trips, token fields are binary, upcasters run on old payloads."""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
import typing
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.errors import StoreError
from store import codec, events, packing
from store.codec import EncodedEvent, decode, encode, register_upcaster
from store.events import EVENT_TYPES, Event, LLMCallCompleted, TokenIds, TrainStepCompleted
from store.tokens import Tokens

# Values chosen to be exact in float32, so a round trip compares equal without rounding.
_SAMPLES: dict[str, Any] = {
    "str": "sample-é",
    "int": 7,
    "float": 0.5,
    "TokenIds": (1, 2, 3, 2**31 - 1, -5),
    "Floats": (-0.25, -1.5, 0.0),
    "JsonObject": {"messages": [{"role": "user", "content": "hi"}], "n": 1},
    "tuple[str, ...]": ("r1", "r2"),
    "tuple[JsonObject, ...]": ({"type": "message", "id": "msg_1"},),
    "dict[str, float]": {"loss": 0.125, "kl": 0.0},
    "bool": True,
    "tuple[int, ...]": (3, 0, 2**31 - 1),
    "tuple[float, ...]": (0.1, -1.0, 1e-300),
}


def _sample(cls: type[Event], **overrides: Any) -> Event:
    """An instance of ``cls`` with a sample value for every field, chosen by its annotation."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        assert isinstance(f.type, str)
        if f.name != "ts":
            assert f.type in _SAMPLES, f"add a sample value for {f.type} ({cls.__name__}.{f.name})"
            kwargs[f.name] = _SAMPLES[f.type]
    return cls(ts=1700000000.25, **{**kwargs, **overrides})


def _packed_fields(cls: type[Event]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.type in ("TokenIds", "Floats")]


def _roundtrip(event: Event) -> Event:
    row = encode(event)
    return decode(row.type, row.version, row.ts, row.data, row.blob)


def _type_name(cls: type[Event]) -> str:
    return cls.type


@pytest.mark.parametrize("cls", [EVENT_TYPES[name] for name in sorted(EVENT_TYPES)], ids=_type_name)
def test_every_event_type_round_trips(cls: type[Event]) -> None:
    event = _sample(cls)
    row = encode(event)
    assert (row.type, row.version, row.ts) == (cls.type, cls.version, event.ts)
    assert row.rollout == getattr(event, "rollout", None)
    assert decode(row.type, row.version, row.ts, row.data, row.blob) == event

    payload = json.loads(row.data)
    packed = _packed_fields(cls)
    assert "ts" not in payload
    assert not set(packed) & payload.keys(), "token fields must not be in the JSON"
    assert set(payload) == {f.name for f in dataclasses.fields(cls)} - set(packed) - {"ts"}
    assert len(row.blob) == sum(4 + 4 * len(getattr(event, name)) for name in packed)


def test_token_fields_are_packed_as_int32_and_float32_in_field_order() -> None:
    event = _sample(LLMCallCompleted)
    assert isinstance(event, LLMCallCompleted)
    blob = encode(event).blob
    prompt = event.prompt_ids
    (count,) = struct.unpack_from("<I", blob, 0)
    assert count == len(prompt)
    assert struct.unpack_from(f"<{count}i", blob, 4) == prompt
    offset = 4 + 4 * count + 4 + 4 * len(event.response_ids)
    (n_logprobs,) = struct.unpack_from("<I", blob, offset)
    assert struct.unpack_from(f"<{n_logprobs}f", blob, offset + 4) == event.response_logprobs
    offset += 4 + 4 * n_logprobs
    (n_versions,) = struct.unpack_from("<I", blob, offset)
    assert struct.unpack_from(f"<{n_versions}i", blob, offset + 4) == event.response_versions
    assert len(blob) == offset + 4 + 4 * n_versions


def test_logprobs_come_back_rounded_to_float32() -> None:
    logprobs = (-0.1, -2.718281828, -1e-9)
    event = _sample(LLMCallCompleted, response_logprobs=logprobs)
    decoded = _roundtrip(event)
    assert isinstance(decoded, LLMCallCompleted)
    assert decoded.response_logprobs != logprobs
    assert decoded.response_logprobs == tuple(array("f", logprobs))
    assert decoded.response_logprobs == pytest.approx(logprobs, rel=1e-6)


def test_tuple_fields_come_back_as_tuples() -> None:
    event = TrainStepCompleted(
        ts=1.0, step=3, rollouts=("a", "b"), samples=2, tokens=10, zero_variance_groups=0
    )
    decoded = _roundtrip(event)
    assert isinstance(decoded, TrainStepCompleted)
    assert decoded.rollouts == ("a", "b") and isinstance(decoded.rollouts, tuple)
    assert decoded == event


@pytest.mark.parametrize("ids", [(2**31,), (*range(40), -(2**31) - 1)], ids=["short", "long"])
def test_token_ids_outside_int32_are_refused_when_the_call_is_made(ids: tuple[int, ...]) -> None:
    """A call's ids are int32 as the store keeps them: one beyond is refused before any event
    exists to store (``Tokens``), whatever the field's length."""
    with pytest.raises(OverflowError):
        _sample(LLMCallCompleted, prompt_ids=ids)
    with pytest.raises(OverflowError):
        _sample(LLMCallCompleted, response_ids=ids)


def _array_bytes(code: str, values: tuple[Any, ...]) -> bytes | str:
    try:
        packed = array(code, values)
    except (TypeError, OverflowError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _packed_or_error(code: str, values: tuple[Any, ...]) -> bytes | str:
    try:
        return packing._packed(code, values)
    except (TypeError, OverflowError) as exc:
        return f"{type(exc).__name__}: {exc}"


_ints = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(), st.booleans())
_floats = st.one_of(st.floats(width=32), st.floats(), st.integers(-(2**60), 2**60))


@settings(max_examples=300)
@given(
    ints=st.lists(_ints, max_size=3 * packing._STRUCT_FROM).map(tuple),
    floats=st.lists(_floats, max_size=3 * packing._STRUCT_FROM).map(tuple),
)
def test_packed_fields_are_the_arrays_bytes_or_its_error(
    ints: tuple[Any, ...], floats: tuple[Any, ...]
) -> None:
    # Long fields go through struct, short ones through array: the same bytes, the same errors
    # (a float beyond float32 is array's infinity).
    assert _packed_or_error("i", ints) == _array_bytes("i", ints)
    assert _packed_or_error("f", floats) == _array_bytes("f", floats)  # bytes: NaNs compare too


def test_a_float_beyond_float32_is_stored_as_an_infinity_in_a_long_field() -> None:
    values = (-0.5,) * packing._STRUCT_FROM + (-1e300,)
    assert struct.unpack(f"<{len(values)}f", packing._packed("f", values))[-1] == float("-inf")


def test_unknown_type_is_a_readable_store_error() -> None:
    with pytest.raises(StoreError, match=r"unknown event type 'NoSuchEvent'.*RewardReported"):
        decode("NoSuchEvent", 1, 0.0, "{}", b"")


def test_newer_version_is_refused() -> None:
    row = encode(_sample(events.RewardReported))
    with pytest.raises(StoreError, match="newer appliance"):
        decode(row.type, row.version + 1, row.ts, row.data, row.blob)


def test_corrupt_blob_is_a_store_error() -> None:
    row = encode(_sample(LLMCallCompleted))
    with pytest.raises(StoreError, match="cannot decode"):
        decode(row.type, row.version, row.ts, row.data, row.blob + b"\x00")


# --- upcasting ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Renamed(Event):
    """Version 3 of an event whose v1 called ``label`` "name" and had no ``weight``."""

    type: typing.ClassVar[str] = "TestRenamed"
    version: typing.ClassVar[int] = 3
    label: str
    weight: float
    ids: TokenIds


del EVENT_TYPES[Renamed.type]  # registered only while a test uses the fixture below


@pytest.fixture
def upcasters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Register ``Renamed`` and its upcasters for one test."""
    monkeypatch.setitem(EVENT_TYPES, Renamed.type, Renamed)
    monkeypatch.setattr(codec, "UPCASTERS", {})

    @register_upcaster("TestRenamed", 1)
    def _v1_v2(data: dict[str, Any]) -> dict[str, Any]:
        return {"label": data["name"], "ids": data.get("ids", ())}

    @register_upcaster("TestRenamed", 2)
    def _v2_v3(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "weight": 1.0}

    yield


@pytest.mark.usefixtures("upcasters")
def test_upcasters_bring_old_payloads_to_the_current_version() -> None:
    blob = struct.pack("<I2i", 2, 10, 11)
    old = decode("TestRenamed", 1, 5.0, json.dumps({"name": "x"}), blob)
    assert old == Renamed(ts=5.0, label="x", weight=1.0, ids=Tokens((10, 11)))
    current = Renamed(ts=6.0, label="y", weight=2.0, ids=Tokens(()))
    assert _roundtrip(current) == current


@pytest.mark.usefixtures("upcasters")
def test_a_missing_upcaster_is_reported() -> None:
    del codec.UPCASTERS[("TestRenamed", 2)]
    with pytest.raises(StoreError, match=r"no upcaster registered for TestRenamed v2 -> v3"):
        decode("TestRenamed", 1, 0.0, json.dumps({"name": "x"}), b"")


@pytest.mark.usefixtures("upcasters")
def test_registering_an_upcaster_twice_fails() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_upcaster("TestRenamed", 1)(lambda data: data)


#: Each event type's JSON keys and packed fields, in stored order: a log written before
#: reads back, and an event written again is the same bytes, only while these hold.
_STORED_ORDER: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "AdmissionsPaused": (("failures", "backoff_s", "cause", "trips"), ()),
    "ApplianceStarted": (
        (
            "run_id",
            "model",
            "engine",
            "resumed_from_version",
            "resumed_from_step",
            "config",
            "trainer_ranks",
            "placement",
            "agents",
            "command",
        ),
        (),
    ),
    "ApplianceStopped": (("reason", "failed", "command"), ()),
    "CallRewardReported": (("rollout", "call_id", "reward", "source", "name"), ()),
    "CheckpointSaved": (("step", "policy_version", "path", "reason"), ()),
    "ControlRequested": (("action", "source"), ()),
    "EngineCaughtUp": (("replica", "policy_version"), ()),
    "EngineLost": (("replica", "reason", "removed"), ()),
    "EngineRegistered": (("replica", "url", "model", "policy_version", "max_model_len", "weights"), ()),
    "EvaluationCompleted": (
        (
            "step",
            "policy_version",
            "split",
            "repeat",
            "rollouts",
            "reward_mean",
            "reward_std",
            "failed",
            "sampling",
            "agent",
        ),
        (),
    ),
    "LLMCallCompleted": (
        (
            "rollout",
            "call_id",
            "surface",
            "policy_version",
            "finish_reason",
            "request",
            "response_text",
            "queue_s",
            "total_s",
            "user_agent",
            "spliced_tokens",
            "ttft_s",
            "unmatched_assistant_turns",
            "sampling",
            "preemptions",
            "assistant_turns",
            "stop_sequence",
        ),
        ("prompt_ids", "response_ids", "response_logprobs", "response_versions"),
    ),
    "LLMCallRefused": (("rollout", "route", "status", "code", "error_type", "message"), ()),
    "ModelExported": (("step", "policy_version", "path"), ()),
    "PhaseChanged": (("phase", "policy_version"), ()),
    "PhaseOverran": (("phase", "step", "deadline_s", "reason", "preempted"), ()),
    "PolicyVersionPublished": (("policy_version", "step", "checkpoint"), ()),
    "ResponseDeleted": (("rollout", "response_id"), ()),
    "ResponseStored": (("rollout", "response", "input_items"), ()),
    "RewardReported": (("rollout", "reward", "source"), ()),
    "RolloutClaimed": (("rollout",), ()),
    "RolloutCreated": (("rollout", "task_id", "group", "task", "policy_version", "adapter", "purpose"), ()),
    "RolloutFinished": (("rollout", "status", "error", "duration_s"), ()),
    "SwitchPhaseCompleted": (("step", "phase", "duration_s"), ()),
    "TrainStepCompleted": (
        (
            "step",
            "rollouts",
            "samples",
            "tokens",
            "zero_variance_groups",
            "metrics",
            "duration_s",
            "sampled",
            "rewards",
        ),
        (),
    ),
    "TrainStepFailed": (("step", "groups", "error", "attempt"), ()),
    "ValidationCompleted": (
        ("step", "policy_version", "rollouts", "reward_mean", "reward_std", "failed", "sampling"),
        (),
    ),
}


def test_every_event_type_keeps_its_stored_order() -> None:
    stored = {}
    for name, cls in EVENT_TYPES.items():
        row = encode(_sample(cls))
        stored[name] = (tuple(json.loads(row.data)), tuple(_packed_fields(cls)))
    assert stored == _STORED_ORDER


def test_encoded_event_is_plain_columns() -> None:
    row = encode(events.ApplianceStopped(ts=2.0, reason="done"))
    data = '{"reason":"done","failed":false,"command":"up"}'
    assert row == EncodedEvent("ApplianceStopped", 1, None, 2.0, data, b"")


@pytest.mark.parametrize(
    "request_body",
    [
        {"messages": [{"role": "user", "content": "hi ünïcode \u2028"}], "n": 1.5e-7},
        {"seed": 2**70, "neg": -(2**63) - 1, "tools": None},
        {"temperature": float("inf"), "top_p": float("-inf")},
        {"seed": None, "stop": ["a"], "top_p": 1.0},
        {"content": "a number 12345678901234567890 in text, and NaN"},
        {"big": [2**64, 2**63 - 1, -(2**64), 10**30], "small": 0.00013639400276588276},
        {"large floats": [1e300, -1.5e19, 2.0**63], "ints": [2**64 - 1, -(2**63)]},
    ],
)
def test_json_holds_what_the_standard_library_would_and_reads_back_exactly(
    request_body: dict[str, Any],
) -> None:
    event = _sample(LLMCallCompleted, request=request_body)
    packed = _packed_fields(LLMCallCompleted)
    fields = [f.name for f in dataclasses.fields(event) if f.name != "ts" and f.name not in packed]
    stdlib = json.dumps({name: getattr(event, name) for name in fields})
    assert json.loads(encode(event).data) == json.loads(stdlib)  # the same values, read by anyone
    assert _roundtrip(event) == event


def test_long_fractions_are_read_without_the_standard_library(monkeypatch: pytest.MonkeyPatch) -> None:
    # A float's repr may hold 19 digits in a row after its point; that is no big integer.
    event = _sample(LLMCallCompleted, queue_s=0.00013639400276588276, total_s=1.2345678901234567e-7)
    row = encode(event)
    assert "00013639400276588276" in row.data

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("read by the standard library")

    monkeypatch.setattr(json, "loads", refuse)
    assert _roundtrip(event) == event


def test_a_payload_with_nulls_and_finite_numbers_is_written_by_orjson(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request = {"messages": [{"role": "user", "content": None, "n": [1.5, (2.5, None)]}], "seed": None}
    event = _sample(LLMCallCompleted, request=request, sampling={"stop_token_ids": (2,), "seed": None})
    expected = json.dumps(
        {"request": request, "sampling": {"stop_token_ids": [2], "seed": None}}, separators=(",", ":")
    )

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("written by the standard library")

    with monkeypatch.context() as patch:
        patch.setattr(json, "dumps", refuse)
        data = json.loads(encode(event).data)
    assert json.dumps({k: data[k] for k in ("request", "sampling")}, separators=(",", ":")) == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_deep_in_a_payload_is_written_as_the_standard_library_does(value: float) -> None:
    event = _sample(LLMCallCompleted, request={"a": [{"b": (1, {"c": value})}], "d": None})
    data = encode(event).data
    assert json.dumps(value) in data
    decoded = _roundtrip(event)
    assert isinstance(decoded, LLMCallCompleted)
    got = decoded.request["a"][0]["b"][1]["c"]
    assert got == value or (got != got and value != value)


def test_nan_in_a_payload_reads_back_as_nan() -> None:
    event = _sample(TrainStepCompleted, metrics={"loss": float("nan"), "grad": None})
    decoded = _roundtrip(event)
    assert isinstance(decoded, TrainStepCompleted)
    assert decoded.metrics["loss"] != decoded.metrics["loss"]  # NaN, not None
    assert decoded.metrics["grad"] is None
