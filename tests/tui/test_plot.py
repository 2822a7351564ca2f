"""Braille line plots: size, direction, and flat series."""

from __future__ import annotations

from tui.plot import braille_plot, format_value


def dots(rows: list[str]) -> list[tuple[int, int]]:
    """(column, row) of every non-blank cell."""
    return [(x, y) for y, row in enumerate(rows) for x, ch in enumerate(row) if ch != " "]


def test_canvas_has_the_requested_size() -> None:
    rows = braille_plot([(0, 0.0), (1, 1.0)], 10, 3)
    assert len(rows) == 3 and all(len(r) == 10 for r in rows)
    assert braille_plot([], 4, 2) == ["    ", "    "]


def test_rising_series_goes_from_bottom_left_to_top_right() -> None:
    cells = dots(braille_plot([(0, 0.0), (1, 1.0), (2, 2.0)], 12, 4))
    assert (0, 3) in cells and (11, 0) in cells
    assert all(ch == " " for ch in braille_plot([(0, 0.0), (1, 1.0)], 12, 4)[0][:6])


def test_flat_and_single_point_series_sit_mid_height() -> None:
    flat = dots(braille_plot([(0, 5.0), (1, 5.0)], 8, 3))
    assert {y for _, y in flat} == {1}
    single = dots(braille_plot([(3, 2.0)], 8, 3))
    assert len(single) == 1


def test_format_value() -> None:
    assert format_value(0) == "0"
    assert format_value(0.1234) == "0.123"
    assert format_value(12.34) == "12.3"
    assert format_value(12345.0) == "1.2e+04"
