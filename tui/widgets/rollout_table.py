"""A light table of rollout rows: draws only the rows on screen, as one block of text.

Owns the cursor, scrolling and drawing of :class:`~tui.model.RolloutRow` lists. Textual's
``DataTable`` renders every visible cell through Rich one by one (about 0.5 ms a cell here), which
made a tab switch cost hundreds of milliseconds at 160x48; this draws the same rows in one
``Text``. Enter (or a click) posts :class:`~tui.messages.RolloutSelected`.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.widget import Widget

from tui.messages import RolloutSelected
from tui.model import RolloutRow

#: (label, width) of each column.
COLUMNS = (
    ("rollout", 14),
    ("task", 22),
    ("status", 8),
    ("reward", 7),
    ("calls", 5),
    ("sampled", 7),
    ("v", 3),
    ("step", 4),
    ("time", 7),
)
#: The last column, why a rollout failed, takes the width the others leave (at least this).
REASON = ("reason", 8)
STATUS_STYLE = {"offered": "blue", "running": "cyan", "finished": "green", "failed": "red"}


def cells(row: RolloutRow) -> tuple[str, ...]:
    return (
        row.rollout,
        row.task_id + (" (val)" if row.purpose == "validation" else ""),
        row.status,
        "-" if row.reward is None else f"{row.reward:+.3f}",
        str(row.calls),
        str(row.sampled),
        str(row.version),
        "-" if row.trained_step is None else str(row.trained_step),
        "-" if row.duration_s is None else f"{row.duration_s:.1f}s",
        row.reason,
    )


def _width(columns: tuple[tuple[str, int], ...]) -> int:
    """Cells the columns take, with the space after each."""
    return sum(width + 1 for _, width in columns)


def _fit(value: str, width: int) -> str:
    return value[: width - 1] + "…" if len(value) > width else value.ljust(width)


class RolloutTable(Widget, can_focus=True):
    """Rows newest first; a header line, then the rows that fit."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "move(-1)", "up", show=False),
        Binding("down", "move(1)", "down", show=False),
        Binding("pageup", "move(-20)", "page up", show=False),
        Binding("pagedown", "move(20)", "page down", show=False),
        Binding("home", "move(-1000000)", "first", show=False),
        Binding("end", "move(1000000)", "last", show=False),
        Binding("enter", "select", "open"),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: list[RolloutRow] = []
        self.cursor = 0
        self._top = 0

    @property
    def row_count(self) -> int:
        return len(self.rows)

    @property
    def selected(self) -> RolloutRow | None:
        return self.rows[self.cursor] if self.rows else None

    def set_rows(self, rows: list[RolloutRow]) -> None:
        """New rows; the cursor stays on the same rollout when it is still listed."""
        current = self.selected.rollout if self.selected else None
        self.rows = rows
        keys = [r.rollout for r in rows]
        self.cursor = keys.index(current) if current in keys else min(self.cursor, max(len(rows) - 1, 0))
        self.refresh()

    def action_move(self, delta: int) -> None:
        if self.rows:
            self.cursor = min(max(self.cursor + delta, 0), len(self.rows) - 1)
            self.refresh()

    def action_select(self) -> None:
        if self.selected is not None:
            self.post_message(RolloutSelected(self.selected.rollout))

    def on_click(self, event: events.Click) -> None:
        index = self._top + event.y - 1
        if event.y >= 1 and 0 <= index < len(self.rows):
            self.cursor = index
            self.refresh()
            if event.chain >= 2:
                self.action_select()

    def render(self) -> Text:
        visible = max(self.content_size.height - 1, 1)
        if self.cursor < self._top:
            self._top = self.cursor
        elif self.cursor >= self._top + visible:
            self._top = self.cursor - visible + 1
        self._top = min(self._top, max(len(self.rows) - visible, 0))
        columns = (*COLUMNS, (REASON[0], max(self.content_size.width - _width(COLUMNS), REASON[1])))
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" ".join(_fit(label, width) for label, width in columns), style="bold")
        if not self.rows:
            text.append("\nno rollouts match", style="dim")
        for index in range(self._top, min(self._top + visible, len(self.rows))):
            row = self.rows[index]
            line = Text(" ".join(_fit(v, w) for v, (_, w) in zip(cells(row), columns, strict=True)))
            status_at = sum(w + 1 for _, w in COLUMNS[:2])
            line.stylize(STATUS_STYLE.get(row.status, ""), status_at, status_at + COLUMNS[2][1])
            if index == self.cursor:
                line.stylize("reverse" if self.has_focus else "underline")
            text.append("\n")
            text.append_text(line)
        return text

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
