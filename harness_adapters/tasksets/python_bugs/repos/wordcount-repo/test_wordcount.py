from wordcount import count_words


def test_single_spaces() -> None:
    assert count_words("the quick brown fox") == 4


def test_runs_of_whitespace() -> None:
    assert count_words("the  quick\nbrown\tfox ") == 4


def test_empty_text() -> None:
    assert count_words("") == 0
