"""Counting words in text."""


def count_words(text: str) -> int:
    """How many words ``text`` holds (words are separated by any whitespace)."""
    return len(text.split(" "))
