"""The blob of a row: an event's token ids and log-probabilities, packed as binary.

Owns each event class's :class:`Layout` (which fields go to ``data`` as JSON, which to ``blob``)
and the blob's format: every field annotated ``TokenIds`` or ``Floats``, in declared field order,
as a 4-byte little-endian count and that many int32 or float32 little-endian values; a count with
:data:`SHARED_FLAG` set is followed by (earlier call's position, shared length) and only the
values after the shared prefix. It does not own the JSON, what is shared with which call, nor
rebuilding it (``store.codec``).
"""

from __future__ import annotations

import dataclasses
import operator
import struct
import sys
import typing
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from store import events as _events
from store.events import Event
from store.tokens import Tokens

_COUNT = struct.Struct("<I")
_NO_VALUES = _COUNT.pack(0)
#: Set in a packed field's count word: the field is (earlier call's position, shared length, suffix).
SHARED_FLAG = 0x8000_0000
_REF = struct.Struct("<QI")
_TYPECODES = {"TokenIds": "i", "Floats": "f"}  # int32 / float32 on every platform we run on
assert array("i").itemsize == 4 and array("f").itemsize == 4
_SWAP = sys.byteorder == "big"
#: Fields of this many values or more are packed by ``struct`` (see :func:`_packed`).
_STRUCT_FROM = 16


@dataclass(frozen=True, slots=True)
class Layout:
    """How the fields of one event class are split between ``data`` and ``blob``."""

    packed: tuple[tuple[str, str], ...]  # (field name, typecode), in declared order
    json_fields: tuple[str, ...]
    tuple_fields: frozenset[str]  # JSON fields to turn back from lists into tuples
    #: The values of ``json_fields`` and of the ``packed`` fields, each as one tuple (C getters).
    json_values: Callable[[Event], tuple[Any, ...]]
    packed_values: Callable[[Event], tuple[Any, ...]]

    def payload(self, event: Event) -> dict[str, Any]:
        """The JSON fields of ``event`` (``data`` before encoding), in declared order."""
        return dict(zip(self.json_fields, self.json_values(event), strict=True))

    def pack(self, event: Event) -> bytes:
        """The blob of ``event`` with nothing shared (the common case of :func:`pack`)."""
        parts: list[bytes] = []
        for (name, code), field in zip(self.packed, self.packed_values(event), strict=True):
            if not field:
                parts.append(_NO_VALUES)
                continue
            if len(field) >= SHARED_FLAG:
                raise ValueError(f"field {name!r} has too many values ({len(field)})")
            parts.append(_COUNT.pack(len(field)))
            parts.append(_packed(code, field))
        return b"".join(parts)


LAYOUTS: dict[type[Event], Layout] = {}


def layout_of(cls: type[Event]) -> Layout:
    """The layout of ``cls``, made on first use."""
    layout = LAYOUTS.get(cls)
    if layout is None:
        layout = LAYOUTS[cls] = _make_layout(cls)
    return layout


def _make_layout(cls: type[Event]) -> Layout:
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
    return Layout(
        tuple(packed),
        tuple(json_fields),
        frozenset(tuples),
        _getter(json_fields),
        _getter([name for name, _code in packed]),
    )


def _getter(names: Sequence[str]) -> Callable[[Event], tuple[Any, ...]]:
    """A function returning the attributes ``names`` of an event as one tuple."""
    if len(names) >= 2:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda event: (one(event),)
    return lambda event: ()


def pack(event: Event, packed: tuple[tuple[str, str], ...], shared: tuple[str, int, int] | None) -> bytes:
    """The blob of ``event``; ``shared`` = (field, earlier position, shared length) or None."""
    parts: list[bytes] = []
    for name, code in packed:
        field = getattr(event, name)
        flag, ref, skip = 0, b"", 0
        if shared is not None and shared[0] == name:
            _, position, skip = shared
            flag, ref = SHARED_FLAG, _REF.pack(position, skip)
        if type(field) is Tokens:  # its suffix is a slice of its bytes
            values = field.data[skip * 4 :] if skip else field.data
            count = len(values) >> 2
        else:
            field = field[skip:] if skip else field
            count, values = len(field), _packed(code, field)
        if count >= SHARED_FLAG:
            raise ValueError(f"field {name!r} has too many values ({count})")
        parts += (_COUNT.pack(count | flag), ref, values)
    return b"".join(parts)


def _packed(code: str, field: Sequence[Any]) -> bytes:
    """The values of ``field`` as little-endian int32 (``code`` "i") or float32 ("f"): a
    ``Tokens`` field's own bytes, else packed.

    ``struct`` packs a field of hundreds of values in 40-50% of ``array``'s time, one of a few
    values in more: it is used from :data:`_STRUCT_FROM` values on. What it refuses (a value out
    of range or not a number; a float beyond float32, which ``array`` stores as an infinity)
    goes to ``array``, so the bytes and the errors are ``array``'s either way.
    """
    if type(field) is Tokens:
        return field.data
    count = len(field)
    if count >= _STRUCT_FROM:
        try:
            return struct.pack(f"<{count}{code}", *field)
        except (struct.error, OverflowError):
            pass
    values = array(code, field)
    if _SWAP:
        values.byteswap()
    return values.tobytes()


def unpack(
    blob: bytes, packed: tuple[tuple[str, str], ...], prefix: Tokens | None
) -> dict[str, Tokens | tuple[float, ...]]:
    """The packed fields of ``blob`` (int32 fields as ``Tokens``, taken as the bytes are; float32
    ones as tuples); ``prefix`` is the earlier call's tokens its shared field starts with, when it
    has one."""
    out: dict[str, Tokens | tuple[float, ...]] = {}
    offset = 0
    for name, code in packed:
        if offset == len(blob):
            break  # written before this field existed: the dataclass default applies
        (count,) = _COUNT.unpack_from(blob, offset)
        offset += _COUNT.size
        head: Tokens | None = None
        if count & SHARED_FLAG:
            count &= ~SHARED_FLAG
            position, length = _REF.unpack_from(blob, offset)
            offset += _REF.size
            if prefix is None or len(prefix) < length:
                raise ValueError(f"field {name!r} shares {length} tokens with the event at {position}")
            head = prefix[:length]
        end = offset + count * 4
        if end > len(blob):
            raise ValueError(f"blob too short for field {name!r}")
        if code == "i":
            own = Tokens.of_bytes(blob[offset:end])
            out[name] = own if head is None else head + own
        else:
            if head is not None:
                raise ValueError(f"field {name!r} of floats cannot share a prefix")
            values = array(code)
            values.frombytes(blob[offset:end])
            if _SWAP:
                values.byteswap()
            out[name] = tuple(values.tolist())  # (tolist: faster than walking the array)
        offset = end
    if offset != len(blob):
        raise ValueError(f"{len(blob) - offset} unexpected trailing bytes in blob")
    return out


def shared_position(blob: bytes, packed: tuple[tuple[str, str], ...], name: str) -> int | None:
    """The position of the earlier event the packed field ``name`` of ``blob`` refers to, or None."""
    offset = 0
    for field_name, code in packed:
        if offset == len(blob):
            return None
        (count,) = _COUNT.unpack_from(blob, offset)
        offset += _COUNT.size
        if count & SHARED_FLAG:
            return int(_REF.unpack_from(blob, offset)[0]) if field_name == name else None
        offset += count * array(code).itemsize
    return None
