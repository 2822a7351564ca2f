from fizzbuzz import fizzbuzz


def test_first_five() -> None:
    assert fizzbuzz(5) == ["1", "2", "Fizz", "4", "Buzz"]


def test_fifteen_ends_with_fizzbuzz() -> None:
    words = fizzbuzz(15)
    assert len(words) == 15
    assert words[-1] == "FizzBuzz"


def test_zero_is_empty() -> None:
    assert fizzbuzz(0) == []
