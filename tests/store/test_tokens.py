"""``store.tokens.Tokens``: the tuple of ids it replaces, in every way a reader of an event uses one."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from store.tokens import EMPTY, Tokens, tokens

ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40).map(tuple)
indices = st.integers(-50, 50)


@given(
    values=ids,
    start=st.none() | indices,
    stop=st.none() | indices,
    step=st.none() | st.sampled_from([1, 2, -1, 3]),
)
def test_it_reads_as_the_tuple(
    values: tuple[int, ...], start: int | None, stop: int | None, step: int | None
) -> None:
    held = Tokens(values)
    assert len(held) == len(values)
    assert bool(held) == bool(values)
    assert tuple(held) == values and list(held) == list(values) and held.tolist() == list(values)
    assert list(reversed(held)) == list(reversed(values))
    part = held[start:stop:step]
    assert type(part) is Tokens and part == values[start:stop:step]
    for i in range(-len(values), len(values)):
        assert held[i] == values[i]
    with pytest.raises(IndexError):
        held[len(values)]
    for value in values[:3]:
        assert value in held and held.index(value) == values.index(value)
        assert held.count(value) == values.count(value)
    assert 2**40 not in held


@given(a=ids, b=ids)
def test_equality_order_hash_and_sums_are_the_tuples(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    ta, tb = Tokens(a), Tokens(b)
    assert (ta == tb) == (a == b) and (ta != tb) == (a != b)
    assert ta == a and a == ta and (ta != a) is False  # equal to the tuple, from either side
    assert (ta < tb, ta <= tb, ta > tb, ta >= tb) == (a < b, a <= b, a > b, a >= b)
    assert (ta < b, a < tb) == (a < b, a < b)
    assert hash(ta) == hash(a)
    for total in (ta + tb, ta + b, a + tb):
        assert type(total) is Tokens and total == a + b
    assert ta.startswith(tb) == (a[: len(b)] == b)


def test_never_equal_to_a_list_nor_to_text() -> None:
    held = Tokens((1, 2))
    assert held != [1, 2]
    assert held != b"\x01\x00\x00\x00\x02\x00\x00\x00"
    keyed: dict[object, str] = {Tokens((1, 2)): "x"}
    assert keyed[(1, 2)] == "x"  # a tuple key finds it: the same hash and equality


def test_bytes_are_little_endian_int32_and_read_back_without_a_copy() -> None:
    held = Tokens((1, -1, 2**31 - 1))
    assert held.data == b"\x01\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\x7f"
    again = Tokens.of_bytes(held.data)
    assert again == held and again.data is held.data
    with pytest.raises(ValueError, match="whole number"):
        Tokens.of_bytes(b"\x01\x00")


@pytest.mark.parametrize("bad", [(2**31,), (-(2**31) - 1,)])
def test_an_id_beyond_int32_is_refused_when_made(bad: tuple[int, ...]) -> None:
    with pytest.raises(OverflowError):
        Tokens(bad)


@pytest.mark.parametrize("bad", [(1.5,), ("a",), b"\x01\x00\x00\x00", "ab"])
def test_what_is_not_ints_is_refused(bad: object) -> None:
    with pytest.raises(TypeError):
        Tokens(bad)  # type: ignore[arg-type]


def test_it_survives_pickle_and_copy_and_repr_shows_the_ids() -> None:
    held = Tokens((5, 6, 7))
    assert pickle.loads(pickle.dumps(held)) == held
    assert copy.copy(held) is held and copy.deepcopy(held) is held
    assert repr(held) == "Tokens((5, 6, 7))"
    assert tokens(held) is held and tokens([5, 6, 7]) == held
    assert EMPTY == () and len(EMPTY) == 0 and not EMPTY
