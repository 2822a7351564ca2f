from slugify import slugify


def test_lowercase() -> None:
    assert slugify("Hello World") == "hello-world"


def test_punctuation_is_dropped() -> None:
    assert slugify("what's new, 2024?") == "what-s-new-2024"
