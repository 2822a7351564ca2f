import pytest
from median import median


def test_odd_count() -> None:
    assert median([3, 1, 2]) == 2


def test_even_count() -> None:
    assert median([4, 1, 3, 2]) == 2.5


def test_empty() -> None:
    with pytest.raises(ValueError):
        median([])
