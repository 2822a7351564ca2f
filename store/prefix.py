"""Whether a call's token ids start with an earlier call's, without copying either.

Owns :func:`starts_with`, the check behind a call's shared prompt (``store.codec``): the store
writes a reference to an earlier call's tokens only where the ids are equal, and a long
conversation's calls make that check on tens of thousands of ids each time. It does not own what
is shared with which call (``store.codec``, ``store.writer``).

The renderer builds a call's prompt from the same int objects as the rollout's previous prompt
and sampled ids, so the prefix usually holds *the very same objects*. On CPython the check first
compares the two tuples' item pointers with ``memcmp`` (a tuple's items are an array of object
pointers right after its header): equal pointers are the same objects, so the values are equal;
that costs a few microseconds for 30k ids where slicing and comparing the tuples costs a hundred
or more (the slice's copy, its reference counts and its release). Any difference in the pointers,
or a runtime without the fast path, falls back to comparing the values, so the answer is always
the values' equality, whatever built the tuples.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

__all__ = ["starts_with"]

#: Shorter prefixes are compared by value at once (a ``memcmp`` call costs about a microsecond).
_POINTERS_FROM = 256


def _memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's ``memcmp`` (it releases the GIL while it runs), or None where the item
    pointers cannot be read this way (not CPython, or no C library found)."""
    if sys.implementation.name != "cpython" or tuple.__itemsize__ != ctypes.sizeof(ctypes.c_void_p):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") if sys.platform != "linux" else None)
        fn = libc.memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_int
    # The layout read here, checked once: equal pointers where the items are the same objects,
    # different ones where one differs (else the fast path stays off).
    a, b, c = object(), object(), object()
    same, longer, different = (a, b), (a, b, c), (a, c)
    if fn(id(same) + _ITEMS, id(longer) + _ITEMS, 2 * _POINTER) != 0:
        return None
    if fn(id(same) + _ITEMS, id(different) + _ITEMS, 2 * _POINTER) == 0:
        return None
    return fn


#: Where a tuple's item pointers start, from its address (``id``) on CPython.
_ITEMS = tuple.__basicsize__
_POINTER = tuple.__itemsize__
_MEMCMP = _memcmp()


def starts_with(values: tuple[int, ...], prefix: tuple[int, ...]) -> bool:
    """``values[:len(prefix)] == prefix``, without the slice where both hold the same objects."""
    n = len(prefix)
    if len(values) < n:
        return False
    if (
        _MEMCMP is not None
        and n >= _POINTERS_FROM
        and type(values) is tuple
        and type(prefix) is tuple
        # Both tuples stay alive (the caller holds them) and never change while this runs.
        and _MEMCMP(id(values) + _ITEMS, id(prefix) + _ITEMS, n * _POINTER) == 0
    ):
        return True
    return values[:n] == prefix
