"""Line plots drawn with braille characters: pure functions from points to lines of text.

Owns the rasterisation (each character cell holds 2x4 dots) and the axis scaling. It does not
own widgets or colours (``tui.widgets.curves``). Deterministic: same points and size, same text.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

_BRAILLE = 0x2800
#: Dot bit of (column, row) inside one cell.
_DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


def bounds(values: Sequence[float]) -> tuple[float, float]:
    """Min and max, widened when flat so that a constant series sits mid-height."""
    low, high = min(values), max(values)
    if high - low < 1e-12:
        pad = abs(low) * 0.1 or 1.0
        return low - pad, high + pad
    return low, high


def braille_plot(points: Sequence[tuple[float, float]], width: int, height: int) -> list[str]:
    """``points`` (x, y) joined by straight lines on a ``width`` x ``height`` character canvas."""
    width, height = max(width, 1), max(height, 1)
    cells = [[0] * width for _ in range(height)]
    if points:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1 = bounds(xs) if len(points) > 1 else (xs[0] - 1, xs[0] + 1)
        y0, y1 = bounds(ys)
        dots_w, dots_h = width * 2, height * 4

        def to_dot(x: float, y: float) -> tuple[int, int]:
            dx = round((x - x0) / (x1 - x0) * (dots_w - 1))
            dy = round((y1 - y) / (y1 - y0) * (dots_h - 1))
            return min(max(dx, 0), dots_w - 1), min(max(dy, 0), dots_h - 1)

        def set_dot(dx: int, dy: int) -> None:
            cells[dy // 4][dx // 2] |= _DOTS[dx % 2][dy % 4]

        dots = [to_dot(x, y) for x, y in points]
        set_dot(*dots[0])
        for (ax, ay), (bx, by) in itertools.pairwise(dots):
            steps = max(abs(bx - ax), abs(by - ay), 1)
            for i in range(steps + 1):
                set_dot(ax + round((bx - ax) * i / steps), ay + round((by - ay) * i / steps))
    return ["".join(chr(_BRAILLE + c) if c else " " for c in row) for row in cells]


def format_value(value: float) -> str:
    """A short axis label."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000 or magnitude < 0.001:
        return f"{value:.1e}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"
