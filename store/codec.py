"""Codec: one event <-> one row of the ``events`` table.

Owns the row representation of an event (:class:`EncodedEvent`, :class:`StoredEvent`), its JSON,
what a call's row shares with its rollout's previous call, the row checksums, and the upcasters
that bring old payloads up to the current class version. It does not own the event classes
(``store.events``), the binary packing of token ids and log-probabilities (``store.packing``)
nor the SQL (``store.schema``, ``store.eventstore``).

Layout of a row:

* ``data`` is compact JSON of every field except ``ts`` (its own column) and the packed fields.
* ``blob`` holds every field annotated ``TokenIds`` or ``Floats``, in declared field order. Each is
  a 4-byte little-endian count followed by that many int32 (``TokenIds``) or float32 (``Floats``)
  little-endian values. Events without such fields have an empty blob.

Invariant: ``decode(*encode(e)) == e`` for every event whose token ids fit in int32 and whose
floats are exactly representable in float32. Log-probabilities are stored as float32 (half the
bytes of float64, and more precision than the sampler's own bf16/fp32 logits give), so a decoded
``Floats`` field equals the original rounded through float32, not the original itself.

Upcasters transform the JSON payload only: packed fields keep their layout across versions. A new
packed field must be added after the existing ones and have a default; old blobs simply end early.

Prefix sharing: a call's ``prompt_ids`` usually start with the previous call's prompt + response
(same rollout). :func:`share_prefix` stores such a field as a reference instead: the count word
gets :data:`store.packing.SHARED_FLAG` set and is followed by the position of the earlier call and the shared
length, then only the new suffix. :func:`decode` rebuilds the field from the earlier call's
:func:`prefix_source` (the store resolves the reference, see :func:`shared_prefix_ref`). Blobs
written before this existed never set the flag (counts stay below 2**31).

Request sharing: a call's ``request`` usually repeats the previous call's conversation (its
``messages``, or a Responses ``input`` list) and adds the newest turns, so storing it whole makes a
conversation of n turns cost O(n^2) bytes. :func:`share_request` stores such a request with only
the new messages, and ``data`` gets a first key :data:`REQUEST_REF` = [earlier call's position,
conversation key, shared message count]; :func:`decode` rebuilds the list from the earlier call's
decoded request (the store resolves the reference, see :func:`shared_ref`). Decoded requests may
share message objects with earlier decoded calls: events are values, never mutate them.

JSON: written with orjson (compact, UTF-8). A payload whose values orjson would store differently
from the standard library (NaN or infinities, which orjson turns into ``null``, so any text with
``null``; integers beyond 64 bits; non-string keys) is written by ``json.dumps``, as before;
reads take the standard library for the texts orjson would read differently. Either way the
stored values are the standard library's (only the spelling of some floats differs).

Row checksums: :func:`chain_digest` hashes a row's columns together with the previous row's
digest (BLAKE2b, 16 bytes), so each digest covers the whole log up to its row.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from contracts.errors import StoreError
from store.events import EVENT_TYPES, Event, JsonObject, LLMCallCompleted
from store.packing import LAYOUTS, Layout, layout_of, pack, shared_position, unpack
from store.tokens import Tokens, tokens

Upcaster = Callable[[JsonObject], JsonObject]

#: (event type, stored version) -> function turning a payload of that version into the next one.
UPCASTERS: dict[tuple[str, int], Upcaster] = {}

#: Shorter common prefixes are stored whole (a reference costs 12 bytes, three tokens).
MIN_SHARED_TOKENS = 8
#: The one packed field stored with a shared prefix, per event type.
_SHARED_FIELD = {LLMCallCompleted.type: "prompt_ids"}
#: First key of a ``data`` whose request shares its conversation with an earlier call (not a
#: field name: fields are identifiers).
REQUEST_REF = "@request"
_REQUEST_REF_HEAD = '{"' + REQUEST_REF + '":['
#: Request keys that hold a conversation as a list of messages.
_CONVERSATION_KEYS = ("messages", "input")
#: orjson reads integers of up to 64 bits exactly and larger ones as floats: a float this large
#: (in magnitude) in what it read may have been such an integer, which Python's json reads exactly.
INEXACT_FROM = 2.0**63
#: Types orjson would write but ``json.dumps`` writes differently or refuses: left to the latter.
_ORJSON_STRICT = (
    orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
)
_DIGEST_SIZE = 16
_blake2b = hashlib.blake2b
_ROW_HEADER = struct.Struct("<qqdIiII")


class EncodedEvent(NamedTuple):
    """An event as the columns of one row (everything but its position), in column order."""

    type: str
    version: int
    rollout: str | None
    ts: float
    data: str
    blob: bytes


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event together with its global position in the log (1, 2, 3, ... without gaps)."""

    position: int
    event: Event


def register_upcaster(type_name: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register ``fn`` to turn a ``type_name`` payload of ``from_version`` into ``from_version + 1``.

    Put it next to the event class::

        @register_upcaster("RewardReported", 1)
        def _reward_v1_v2(data: JsonObject) -> JsonObject:
            return {**data, "source": data.pop("grader", "")}
    """

    def decorator(fn: Upcaster) -> Upcaster:
        key = (type_name, from_version)
        if key in UPCASTERS:
            raise ValueError(f"an upcaster for {type_name} v{from_version} is already registered")
        UPCASTERS[key] = fn
        return fn

    return decorator


def encode(event: Event) -> EncodedEvent:
    """Split ``event`` into the columns of a row. Raises StoreError if it cannot be stored."""
    layout = LAYOUTS.get(type(event)) or layout_of(type(event))
    rollout = event.rollout_id
    try:
        data = _dumps(layout.payload(event))
        if rollout is not None:
            rollout.encode("utf-8")
        blob = layout.pack(event)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"cannot encode {event.type} event: {exc}") from exc
    return EncodedEvent(event.type, event.version, rollout, event.ts, data, blob)


def _dumps(payload: JsonObject) -> str:
    """Compact JSON of ``payload``, exactly as ``json.dumps`` writes it where the two differ."""
    try:
        raw = orjson.dumps(payload, option=_ORJSON_STRICT)
    except TypeError:  # big integers, non-string keys, lone surrogates...: the standard library's way
        raw = None
    # orjson writes NaN and infinities as null: with a null written, look for one of those.
    if raw is None or (b"null" in raw and _float_beyond(payload, math.inf)):
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        # SQLite text and the checksum are UTF-8: a lone surrogate must fail here, in this
        # event's encoding, not in its transaction.
        data.encode("utf-8")
        return data
    return raw.decode()


def _float_beyond(value: JsonObject | list[Any], bound: float) -> bool:
    """Whether ``value`` holds, however deep, a float ``f`` outside ``-bound < f < bound`` (NaN
    included; ``math.inf``: the non-finite ones). Walks the containers only: a long text costs
    nothing."""
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        for child in item.values() if type(item) is dict else item:
            kind = type(child)
            if kind is float:
                if not -bound < child < bound:
                    return True
            elif kind is dict or kind is list or kind is tuple:
                stack.append(child)
    return False


def _loads(data: str) -> Any:
    """``json.loads(data)``, read by orjson unless the standard library reads it differently:
    NaN and the infinities (orjson refuses them), integers beyond 64 bits (orjson's floats)."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
    if isinstance(value, dict | list) and _float_beyond(value, INEXACT_FROM):
        return json.loads(data)
    return value


def prefix_source(event: Event) -> Tokens | None:
    """The tokens a later call of the same rollout may start with (prompt + response), if any."""
    if isinstance(event, LLMCallCompleted):
        return tokens(event.prompt_ids) + tokens(event.response_ids)
    return None


def share_prefix(row: EncodedEvent, event: Event, position: int, source: Tokens) -> EncodedEvent:
    """``row`` (``encode(event)``) with its shared field stored as a reference to ``source``.

    ``source`` is :func:`prefix_source` of the earlier event at ``position``. The row comes back
    unchanged when the common prefix is shorter than :data:`MIN_SHARED_TOKENS`.
    """
    name = _SHARED_FIELD.get(event.type)
    if name is None:
        return row
    shared = _common_prefix(getattr(event, name), source)
    if shared < MIN_SHARED_TOKENS:
        return row
    blob = pack(event, layout_of(type(event)).packed, (name, position, shared))
    return row._replace(blob=blob)


def encode_shared(event: LLMCallCompleted, position: int, earlier: LLMCallCompleted) -> EncodedEvent:
    """``encode(event)`` with its prompt and request shared with ``earlier`` (the call at ``position``).

    The same row as :func:`share_request` of :func:`share_prefix` of :func:`encode`, built without
    packing or writing what is shared: its cost grows with the new tokens and messages, not
    with the conversation. Raises StoreError if the event cannot be stored.
    """
    layout = layout_of(LLMCallCompleted)
    try:
        shared = _prefix_length(event.prompt_ids, earlier.prompt_ids, earlier.response_ids)
        data = _dumps(_shared_payload(event, position, earlier.request) or layout.payload(event))
        event.rollout.encode("utf-8")
        ref = ("prompt_ids", position, shared) if shared >= MIN_SHARED_TOKENS else None
        blob = pack(event, layout.packed, ref)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"cannot encode {event.type} event: {exc}") from exc
    return EncodedEvent(event.type, event.version, event.rollout, event.ts, data, blob)


def _prefix_length(prompt: Sequence[int], before: Sequence[int], after: Sequence[int]) -> int:
    """``_common_prefix(prompt, before + after)`` (an earlier call's prompt and response),
    compared as the ids' bytes: 4 bytes an id, so the ids two runs of bytes share are the whole
    ids among the bytes they share. Where the prompt holds the whole earlier call (the common
    case: its answer spliced in), two ``startswith`` say so, building nothing."""
    ids, earlier, answer = tokens(prompt).data, tokens(before).data, tokens(after).data
    n = len(earlier)
    if ids.startswith(earlier):
        if ids.startswith(answer, n):
            return (n + len(answer)) >> 2
        m = min(len(answer), len(ids) - n)
        return (n + _common_prefix(ids[n : n + m], answer[:m])) >> 2
    return _common_prefix(ids, earlier + answer) >> 2


def share_request(row: EncodedEvent, event: Event, position: int, earlier: JsonObject) -> EncodedEvent:
    """``row`` with its request's conversation stored as the messages after those it shares with
    ``earlier`` (the request of the call at ``position``); unchanged when they share none."""
    if not isinstance(event, LLMCallCompleted):
        return row
    payload = _shared_payload(event, position, earlier)
    return row if payload is None else row._replace(data=_dumps(payload))


def _shared_payload(event: LLMCallCompleted, position: int, earlier: JsonObject) -> JsonObject | None:
    """The JSON fields of ``event`` with its request's conversation cut to the messages after
    those it shares with ``earlier`` (the request of the call at ``position``) and the reference
    first; None when they share none."""
    request = event.request
    for key in _CONVERSATION_KEYS:
        messages, before = request.get(key), earlier.get(key)
        if isinstance(messages, list) and isinstance(before, list):
            break
    else:
        return None
    shared = _common_prefix(messages, before)
    if shared == 0:
        return None
    payload: JsonObject = {REQUEST_REF: [position, key, shared], **layout_of(LLMCallCompleted).payload(event)}
    payload["request"] = {**request, key: messages[shared:]}
    return payload


def shared_ref(type_name: str, data: str, blob: bytes) -> int | None:
    """The position of the earlier call a row shares tokens or its request with, or None.

    A row refers to at most one earlier call (its rollout's previous one).
    """
    ref = shared_prefix_ref(type_name, blob)
    if ref is None and (request_ref := _request_ref(data)) is not None:
        ref = request_ref[0]
    return ref


def _request_ref(data: str) -> tuple[int, str, int] | None:
    """A row's leading :data:`REQUEST_REF`: the earlier call's position, the conversation key of
    the request and how many of its messages the row shares; None for a row that shares none."""
    if not data.startswith(_REQUEST_REF_HEAD):
        return None
    start = len(_REQUEST_REF_HEAD) - 1
    position, key, shared = orjson.loads(data[start : data.index("]", start) + 1])
    return position, key, shared


def shared_prefix_ref(type_name: str, blob: bytes) -> int | None:
    """The position of the earlier event a row's shared field refers to, or None."""
    name = _SHARED_FIELD.get(type_name)
    cls = EVENT_TYPES.get(type_name)
    if name is None or cls is None:
        return None
    return shared_position(blob, layout_of(cls).packed, name)


def chain_digest(previous: bytes, position: int, row: EncodedEvent) -> bytes:
    """The checksum of the row at ``position``, chained over ``previous`` (b"" before the first)."""
    type_name, version, rollout_id, ts, text, blob = row
    type_bytes = type_name.encode()
    data = text.encode()
    if rollout_id is None:
        rollout, rollout_size = b"", -1
    else:
        rollout = rollout_id.encode()
        rollout_size = len(rollout)
    header = _ROW_HEADER.pack(position, version, ts, len(type_bytes), rollout_size, len(data), len(blob))
    # One call over the concatenation: the same digest as updating part by part.
    return _blake2b(
        b"".join((previous, header, type_bytes, rollout, data, blob)), digest_size=_DIGEST_SIZE
    ).digest()


def decode(
    type_name: str,
    version: int,
    ts: float,
    data: str,
    blob: bytes,
    prefix: Tokens | None = None,
    request: JsonObject | None = None,
) -> Event:
    """Rebuild the event stored in a row, upcasting its payload to the current class version.

    ``prefix`` is :func:`prefix_source` and ``request`` the request of the event
    :func:`shared_ref` names, when it names one. A shared request is rebuilt before upcasting.
    """
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        known = ", ".join(sorted(EVENT_TYPES))
        raise StoreError(f"unknown event type {type_name!r} in the store (known types: {known})")
    if version > cls.version:
        raise StoreError(
            f"{type_name} v{version} was written by a newer appliance (this one knows v{cls.version})"
        )
    layout = layout_of(cls)
    try:
        fields: dict[str, Any] = _loads(data)
        if REQUEST_REF in fields:
            fields["request"] = _rebuild_request(fields.pop(REQUEST_REF), fields["request"], request)
        for v in range(version, cls.version):
            upcaster = UPCASTERS.get((type_name, v))
            if upcaster is None:
                raise StoreError(f"no upcaster registered for {type_name} v{v} -> v{v + 1}")
            fields = upcaster(fields)
        for name in layout.tuple_fields & fields.keys():
            fields[name] = tuple(fields[name])
        fields.update(unpack(blob, layout.packed, prefix))
        return cls(ts=ts, **fields)
    except (TypeError, ValueError, KeyError, struct.error) as exc:
        raise StoreError(f"cannot decode {type_name} v{version}: {exc}") from exc


def as_stored(event: Event, row: EncodedEvent) -> Event:
    """:func:`decode` of ``row``, the row ``event`` was just stored as, without rebuilding what
    the row shares with an earlier call: its packed fields come from ``event`` (log-probabilities
    rounded through float32 as stored), the messages its request shares from ``event``'s request,
    the rest from the row. Costs what is new in the row, not the conversation.

    ``event`` itself where that is what the row reads back as (:func:`_reads_back_as`): its JSON
    fields hold only what JSON gives back alike (no tuple inside, no NaN, string keys) and its
    log-probabilities are float32 values already, as an engine's are. A call as the proxy
    records it is, so it costs a walk over its new values instead of a JSON reading and a copy.
    """
    layout = layout_of(type(event))
    try:
        if _reads_back_as(event, layout, row):
            return event
        fields: dict[str, Any] = _loads(row.data)
        ref = fields.pop(REQUEST_REF, None)
        if ref is not None and isinstance(event, LLMCallCompleted):
            _position, key, shared = ref
            fields["request"][key] = event.request[key][:shared] + fields["request"][key]
        for name in layout.tuple_fields & fields.keys():
            fields[name] = tuple(fields[name])
        for (name, code), value in zip(layout.packed, layout.packed_values(event), strict=True):
            fields[name] = tuple(array(code, value).tolist()) if code == "f" else tokens(value)
        return type(event)(ts=row.ts, **fields)
    except (TypeError, ValueError, KeyError) as exc:
        raise StoreError(f"cannot decode {row.type} v{row.version}: {exc}") from exc


def _reads_back_as(event: Event, layout: Layout, row: EncodedEvent) -> bool:
    """Whether what :func:`as_stored` reads from ``row`` equals ``event``'s own values, of the same
    types throughout: every JSON field JSON-exact (:func:`_json_exact`; a tuple field a tuple of
    such values), the messages the row's request shares with an earlier call taken from
    ``event`` as they are (as :func:`as_stored` takes them), each id field ``Tokens``, each
    float field a tuple its values unchanged by float32."""
    if row.ts != event.ts:
        return False
    ref = _request_ref(row.data)
    tuples = layout.tuple_fields
    for name, value in zip(layout.json_fields, layout.json_values(event), strict=True):
        kind = type(value)
        if kind is str or kind is int or kind is bool or value is None:
            continue  # the common case, ahead of the walk
        if name in tuples:
            exact = kind is tuple and _json_exact(list(value))
        elif name == "request" and ref is not None and kind is dict:
            _position, key, shared = ref
            messages = value.get(key)
            exact = (
                type(messages) is list
                and len(messages) >= shared
                and _json_exact({k: v for k, v in value.items() if k != key})
                and _json_exact(messages[shared:])
            )
        else:
            exact = _json_exact(value)
        if not exact:
            return False
    for (_name, code), value in zip(layout.packed, layout.packed_values(event), strict=True):
        if code != "f":
            if type(value) is not Tokens:
                return False
        elif type(value) is not tuple or tuple(array(code, value).tolist()) != value:
            return False
    return True


def _json_exact(value: Any) -> bool:
    """Whether ``value`` reads back from the JSON :func:`_dumps` writes as an equal value of the
    same types throughout: dicts with string keys, lists, and :func:`_atom_exact` values (a tuple
    would read back as a list; NaN, the infinities and anything else are left to the reading)."""
    if type(value) is not dict and type(value) is not list:
        return _atom_exact(value)
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            for key in item:
                if type(key) is not str:
                    return False
            children = item.values()
        else:  # only dicts and lists are pushed
            children = item
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append(child)
            elif not (
                kind is str
                or kind is int
                or kind is bool
                or child is None
                or (kind is float and -math.inf < child < math.inf)
            ):
                return False
    return True


def _atom_exact(value: Any) -> bool:
    """Whether ``value`` is a string, an integer (of any size: the standard library writes and
    reads those orjson does not), a boolean, None or a finite float."""
    kind = type(value)
    return (
        kind is str
        or kind is int
        or kind is bool
        or value is None
        or (kind is float and -math.inf < value < math.inf)
    )


def _rebuild_request(ref: list[Any], stored: JsonObject, earlier: JsonObject | None) -> JsonObject:
    position, key, shared = ref
    before = None if earlier is None else earlier.get(key)
    if not isinstance(before, list) or len(before) < shared:
        raise ValueError(f"the request shares {shared} messages with the event at {position}")
    stored[key] = before[:shared] + stored[key]
    return stored


def _common_prefix(values: Sequence[Any], source: Sequence[Any]) -> int:
    """Length of the longest common prefix, by bisection over slice comparisons (done in C)."""
    limit = min(len(values), len(source))
    if values[:limit] == source[:limit]:
        return limit
    low, high = 0, limit  # values[:low] == source[:low], values[:high] != source[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if values[:middle] == source[:middle]:
            low = middle
        else:
            high = middle
    return low
