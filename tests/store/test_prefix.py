"""``store.prefix.starts_with``: the values' equality, whether or not the tuples share objects."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from store import prefix
from store.prefix import starts_with

LONG = 5_000  # past the length from which item pointers are compared


def _fresh(values: tuple[int, ...]) -> tuple[int, ...]:
    """Equal values as new int objects (large ints are not cached by the interpreter)."""
    return tuple(int(str(v)) for v in values)


def test_the_fast_path_exists_on_this_interpreter() -> None:
    assert prefix._MEMCMP is not None


def test_same_objects_and_equal_values() -> None:
    ids = [100_000 + i for i in range(LONG)]
    earlier = tuple(ids)
    ids += [7, 8, 9]
    assert starts_with(tuple(ids), earlier)
    assert starts_with(tuple(ids), _fresh(earlier))  # equal values, other objects
    assert starts_with(earlier, earlier)


def test_a_difference_anywhere_is_found() -> None:
    earlier = tuple(100_000 + i for i in range(LONG))
    for at in (0, 1, LONG // 2, LONG - 1):
        changed = list(earlier)
        changed[at] += 1
        assert not starts_with((*changed, 1, 2), earlier)
        assert not starts_with((*changed, 1, 2), _fresh(earlier))


def test_shorter_values_and_short_prefixes() -> None:
    earlier = tuple(range(LONG))
    assert not starts_with(earlier[:-1], earlier)
    assert starts_with((1, 2, 3), ())
    assert starts_with((1, 2, 3), (1, 2))
    assert not starts_with((1, 2, 3), (1, 3))


def test_a_tuple_subclass_is_compared_by_value() -> None:
    class Ids(tuple[int, ...]):
        pass

    earlier = tuple(range(LONG))
    assert starts_with(Ids((*earlier, 5)), earlier)
    assert not starts_with(Ids((*earlier[:-1], -1, 5)), earlier)


@given(st.lists(st.integers(-(2**40), 2**40)), st.lists(st.integers(-(2**40), 2**40)), st.booleans())
def test_agrees_with_slicing(values: list[int], extra: list[int], share: bool) -> None:
    earlier = tuple(values * (1 + LONG // max(1, len(values)))) if values else ()
    longer = (*earlier, *extra) if share else (*_fresh(earlier), *extra)
    candidates = [longer, tuple(extra), (*extra, *earlier)]
    for candidate in candidates:
        assert starts_with(candidate, earlier) == (candidate[: len(earlier)] == earlier)
