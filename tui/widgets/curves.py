"""Training curves: one braille line plot per metric, in a grid that reflows with the terminal.

Owns drawing one series (``CurvePlot``) and the grid of them (``CurvesPanel``); the series come
from ``DashboardModel.curves`` and the rasterising from ``tui.plot``.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid
from textual.widget import Widget

from tui.model import CURVES, VALIDATION, DashboardModel
from tui.plot import braille_plot, format_value

#: (title, series key, colour) in grid order.
PLOTS: tuple[tuple[str, str, str], ...] = (
    ("reward (train)", "reward_mean", "green"),
    ("reward (validation)", VALIDATION, "cyan"),
    ("loss", "loss", "magenta"),
    ("entropy", "entropy", "yellow"),
    ("KL (old || policy)", "ppo_kl", "blue"),
    ("grad norm", "grad_norm", "red"),
)
assert {key for _, key, _ in PLOTS} - {VALIDATION} <= {key for _, key in CURVES}


class CurvePlot(Widget):
    """One metric against the training step."""

    DEFAULT_CLASSES = "curve"

    def __init__(self, title: str, key: str, colour: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.key = key
        self.colour = colour
        self.points: list[tuple[int, float]] = []

    def set_points(self, points: list[tuple[int, float]]) -> None:
        if points != self.points:
            self.points = list(points)
            self.refresh()

    def render(self) -> Text:
        width, height = self.content_size.width, self.content_size.height
        text = Text()
        text.append(self.title, style=f"bold {self.colour}")
        if not self.points:
            text.append("\nno steps yet", style="dim")
            return text
        last_step, last = self.points[-1]
        text.append(f"  {format_value(last)} @ step {last_step}", style="dim")
        values = [v for _, v in self.points]
        low, high = format_value(min(values)), format_value(max(values))
        axis = max(len(low), len(high))
        rows = braille_plot([(float(s), v) for s, v in self.points], width - axis - 1, max(height - 2, 1))
        for i, row in enumerate(rows):
            label = high if i == 0 else low if i == len(rows) - 1 else ""
            text.append(f"\n{label:>{axis}}│", style="dim")
            text.append(row, style=self.colour)
        first_step = self.points[0][0]
        span = f"step {first_step}" + (f" … {last_step}" if last_step != first_step else "")
        text.append(f"\n{'':>{axis}} {span}", style="dim")
        return text


class CurvesPanel(Grid):
    """The grid of curves."""

    def compose(self) -> ComposeResult:
        for title, key, colour in PLOTS:
            yield CurvePlot(title, key, colour, id=f"curve-{key}")

    def on_resize(self) -> None:
        self.styles.grid_size_columns = 3 if self.size.width >= 120 else 2

    def show(self, model: DashboardModel) -> None:
        for plot in self.query(CurvePlot):
            plot.set_points(model.curves.get(plot.key, []))
