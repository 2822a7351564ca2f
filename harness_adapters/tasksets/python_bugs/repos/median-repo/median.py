"""The median of a list of numbers."""


def median(values: list[float]) -> float:
    """The middle value of ``values``; the mean of the two middle ones for an even count."""
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
