"""A call's token ids as one immutable block of int32s: ``Tokens``.

Owns the value type of every token-id field of an event (a call's prompt, its response, each
response token's policy version). A long conversation's prompt is tens of thousands of ids, made
anew for every call and released when the call's event is: as a tuple that is a Python object per
id to reference and release each time (about 80 us a call at 30k ids on the project's machine);
as ``Tokens`` it is one ``bytes`` object, copied and freed in a few microseconds, packed into the
store as it is and read back without unpacking, and compared with an earlier call's prompt by
``memcmp``.

``Tokens`` is a ``Sequence[int]`` that behaves like the tuple it replaces: the same length,
items, slices, iteration, ``+`` and ordering, equal to a tuple of the same ids (and hashing like
it), never to a list; ``repr`` shows ``Tokens((1, 2, 3))``. Ids are int32, as the store keeps
them: one out of that range is refused when the ``Tokens`` is made (``OverflowError``), as the
store refused it when packing before. The bytes are little-endian (the store's format); on a
big-endian machine the views swap them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

__all__ = ["EMPTY", "Tokens", "pack_ids", "tokens"]

_LITTLE = sys.byteorder == "little"
assert array("i").itemsize == 4  # int32 on every platform we run on


def pack_ids(ids: Iterable[int]) -> bytes:
    """``ids`` as little-endian int32 bytes (``Tokens``' own, and what the store writes)."""
    values = array("i", ids)
    if not _LITTLE:  # pragma: no cover
        values.byteswap()
    return values.tobytes()


class Tokens(Sequence[int]):
    """An immutable sequence of int32 token ids, held as little-endian bytes."""

    __slots__ = ("_data",)
    _data: bytes

    def __init__(self, ids: Iterable[int] = ()) -> None:
        if type(ids) is Tokens:
            self._data = ids._data
        elif isinstance(ids, str | bytes | bytearray | memoryview):
            raise TypeError(f"Tokens are made of ints, not {type(ids).__name__} (of_bytes takes bytes)")
        else:
            self._data = pack_ids(ids)

    @classmethod
    def of_bytes(cls, data: bytes) -> Tokens:
        """The ids ``data`` holds as little-endian int32s (its length a multiple of 4), not copied."""
        if len(data) % 4:
            raise ValueError(f"{len(data)} bytes are not a whole number of int32 ids")
        out = cls.__new__(cls)
        out._data = bytes(data)  # the same object when ``data`` is already ``bytes``
        return out

    @property
    def data(self) -> bytes:
        """The ids as little-endian int32 bytes (what the store writes)."""
        return self._data

    def _array(self) -> array[int]:
        values = array("i")
        values.frombytes(self._data)
        if not _LITTLE:  # pragma: no cover
            values.byteswap()
        return values

    def tolist(self) -> list[int]:
        if _LITTLE:
            return memoryview(self._data).cast("i").tolist()
        return self._array().tolist()  # pragma: no cover

    def startswith(self, prefix: Tokens) -> bool:
        """``self[:len(prefix)] == prefix``, compared as bytes (no copy)."""
        return self._data.startswith(prefix._data)

    def __len__(self) -> int:
        return len(self._data) >> 2

    def __bool__(self) -> bool:
        return bool(self._data)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Tokens: ...
    def __getitem__(self, index: int | slice) -> int | Tokens:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return Tokens.of_bytes(self._data[start * 4 : max(start, stop) * 4])
            return Tokens(self.tolist()[index])
        if _LITTLE:
            return int(memoryview(self._data).cast("i")[index])
        return int(self._array()[index])  # pragma: no cover

    def __iter__(self) -> Iterator[int]:
        if _LITTLE:
            return iter(memoryview(self._data).cast("i").tolist())
        return iter(self._array())  # pragma: no cover

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.tolist())

    def __contains__(self, value: object) -> bool:
        return value in self.tolist()

    def count(self, value: Any) -> int:
        return self.tolist().count(value)

    def index(self, value: Any, start: int = 0, stop: int = sys.maxsize) -> int:
        return self.tolist().index(value, start, stop)

    def __eq__(self, other: object) -> bool:
        if type(other) is Tokens:
            return self._data == other._data
        if isinstance(other, tuple):
            return len(other) == len(self) and tuple(self.tolist()) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.tolist()))  # equal to a tuple of the same ids: the same hash

    def _ordered(self, other: object) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        if type(other) is Tokens:
            return tuple(self.tolist()), tuple(other.tolist())
        if isinstance(other, tuple):
            return tuple(self.tolist()), other
        return None

    def __lt__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] < pair[1]

    def __le__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] <= pair[1]

    def __gt__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] > pair[1]

    def __ge__(self, other: object) -> bool:
        pair = self._ordered(other)
        return NotImplemented if pair is None else pair[0] >= pair[1]

    def __add__(self, other: Tokens | tuple[int, ...]) -> Tokens:
        if type(other) is Tokens:
            return Tokens.of_bytes(self._data + other._data)
        if isinstance(other, tuple):
            return Tokens.of_bytes(self._data + pack_ids(other))
        return NotImplemented

    def __radd__(self, other: tuple[int, ...]) -> Tokens:
        if isinstance(other, tuple):
            return Tokens.of_bytes(pack_ids(other) + self._data)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Tokens({tuple(self.tolist())!r})"

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return Tokens.of_bytes, (self._data,)

    def __copy__(self) -> Tokens:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Tokens:
        return self


def tokens(ids: Iterable[int]) -> Tokens:
    """``ids`` as ``Tokens``: itself when it is already, else packed (``OverflowError`` for an id
    beyond int32, ``TypeError`` for a value that is not an int)."""
    return ids if type(ids) is Tokens else Tokens(ids)


#: No ids (the default of an empty token field).
EMPTY = Tokens()
