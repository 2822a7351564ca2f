"""Codec: one event <-> one row of the ``events`` table.

Owns the row representation of an event (:class:`EncodedEvent`, :class:`StoredEvent`), the binary
packing of token ids and log-probabilities, and the upcasters that bring old payloads up to the
current class version. It does not own the event classes (``store.events``) nor the SQL
(``store.eventstore``).

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
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
import typing
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.errors import StoreError
from store import events as _events
from store.events import EVENT_TYPES, Event, JsonObject

Upcaster = Callable[[JsonObject], JsonObject]

#: (event type, stored version) -> function turning a payload of that version into the next one.
UPCASTERS: dict[tuple[str, int], Upcaster] = {}

_COUNT = struct.Struct("<I")
_TYPECODES = {"TokenIds": "i", "Floats": "f"}  # int32 / float32 on every platform we run on
assert array("i").itemsize == 4 and array("f").itemsize == 4
_SWAP = sys.byteorder == "big"


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    """An event as the columns of one row (everything but its position)."""

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


@dataclass(frozen=True, slots=True)
class _Layout:
    """How the fields of one event class are split between ``data`` and ``blob``."""

    packed: tuple[tuple[str, str], ...]  # (field name, typecode), in declared order
    json_fields: tuple[str, ...]
    tuple_fields: frozenset[str]  # JSON fields to turn back from lists into tuples


_LAYOUTS: dict[type[Event], _Layout] = {}


def _layout(cls: type[Event]) -> _Layout:
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = _make_layout(cls)
    return layout


def _make_layout(cls: type[Event]) -> _Layout:
    module = sys.modules.get(cls.__module__)
    namespace = {**vars(_events), **(vars(module) if module else {})}
    hints = typing.get_type_hints(cls, globalns=namespace)
    packed: list[tuple[str, str]] = []
    json_fields: list[str] = []
    tuples: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.name == "ts":
            continue
        # Annotations are strings (``from __future__ import annotations``): the alias name is what
        # tells a packed field from any other tuple.
        if isinstance(f.type, str) and f.type in _TYPECODES:
            packed.append((f.name, _TYPECODES[f.type]))
            continue
        json_fields.append(f.name)
        if typing.get_origin(hints[f.name]) is tuple:
            tuples.add(f.name)
    return _Layout(tuple(packed), tuple(json_fields), frozenset(tuples))


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
    layout = _layout(type(event))
    payload = {name: getattr(event, name) for name in layout.json_fields}
    parts: list[bytes] = []
    try:
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        for name, code in layout.packed:
            values = array(code, getattr(event, name))
            if _SWAP:
                values.byteswap()
            parts += (_COUNT.pack(len(values)), values.tobytes())
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"cannot encode {event.type} event: {exc}") from exc
    return EncodedEvent(event.type, event.version, event.rollout_id, event.ts, data, b"".join(parts))


def decode(type_name: str, version: int, ts: float, data: str, blob: bytes) -> Event:
    """Rebuild the event stored in a row, upcasting its payload to the current class version."""
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        known = ", ".join(sorted(EVENT_TYPES))
        raise StoreError(f"unknown event type {type_name!r} in the store (known types: {known})")
    if version > cls.version:
        raise StoreError(
            f"{type_name} v{version} was written by a newer appliance (this one knows v{cls.version})"
        )
    layout = _layout(cls)
    try:
        fields: dict[str, Any] = json.loads(data)
        for v in range(version, cls.version):
            upcaster = UPCASTERS.get((type_name, v))
            if upcaster is None:
                raise StoreError(f"no upcaster registered for {type_name} v{v} -> v{v + 1}")
            fields = upcaster(fields)
        for name in layout.tuple_fields & fields.keys():
            fields[name] = tuple(fields[name])
        fields.update(_unpack(blob, layout.packed))
        return cls(ts=ts, **fields)
    except (TypeError, ValueError, KeyError, struct.error) as exc:
        raise StoreError(f"cannot decode {type_name} v{version}: {exc}") from exc


def _unpack(blob: bytes, packed: tuple[tuple[str, str], ...]) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}
    offset = 0
    for name, code in packed:
        if offset == len(blob):
            break  # written before this field existed: the dataclass default applies
        (count,) = _COUNT.unpack_from(blob, offset)
        offset += _COUNT.size
        values = array(code)
        end = offset + count * values.itemsize
        if end > len(blob):
            raise ValueError(f"blob too short for field {name!r}")
        values.frombytes(blob[offset:end])
        if _SWAP:
            values.byteswap()
        out[name] = tuple(values)
        offset = end
    if offset != len(blob):
        raise ValueError(f"{len(blob) - offset} unexpected trailing bytes in blob")
    return out
