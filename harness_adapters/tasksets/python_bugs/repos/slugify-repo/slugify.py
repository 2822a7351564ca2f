"""URL slugs from titles."""

import re


def slugify(title: str) -> str:
    """A lowercase slug: the title's letters and digits, words joined by single dashes."""
    words = re.findall(r"[A-Za-z0-9]+", title)
    return "-".join(words)
