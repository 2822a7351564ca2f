"""FizzBuzz, as a list of words."""


def fizzbuzz(n: int) -> list[str]:
    """The FizzBuzz words for 1, 2, ..., n."""
    words = []
    for i in range(1, n):
        if i % 15 == 0:
            words.append("FizzBuzz")
        elif i % 3 == 0:
            words.append("Fizz")
        elif i % 5 == 0:
            words.append("Buzz")
        else:
            words.append(str(i))
    return words
