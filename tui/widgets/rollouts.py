"""The rollouts table with its filters (status, task, minimum reward), under a line that says
why rollouts failed (the reasons grouped, as ``status`` says them).

Filters are plain inputs (a status prefix such as ``fail``, a task substring, a number): a
``Select`` costs dozens of widgets, and every widget makes each tab switch's layout slower.

Owns the filter inputs and feeding the table (``tui.widgets.rollout_table``) its rows, from
``DashboardModel.rows``; the table posts ``RolloutSelected`` and the app opens the detail screen.
"""

from __future__ import annotations

import time

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Static

from store.outcomes import STATES
from tui.model import DashboardModel, RolloutFilter
from tui.widgets.rollout_table import RolloutTable

#: Most rows drawn (newest first); the filters reach older ones.
MAX_ROWS = 200
#: While new rollouts stream in, the table is rebuilt at most this often (seconds).
LIVE_REFRESH_S = 1.0


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class RolloutsPanel(Vertical):
    """Filters on top, the table below."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.filter = RolloutFilter()
        self._shown: tuple[int, RolloutFilter] | None = None
        self._shown_at = 0.0

    def compose(self) -> ComposeResult:
        with Horizontal(id="rollout-filters"):
            yield Input(placeholder="status: offered/running/finished/failed", id="filter-status")
            yield Input(placeholder="task contains", id="filter-task")
            yield Input(placeholder="reward ≥", id="filter-min-reward", type="number")
        yield Static(id="rollout-failures")
        yield RolloutTable(id="rollouts-table")

    def show(self, model: DashboardModel, *, force: bool = False) -> None:
        key = (model.revision, self.filter)
        if key == self._shown:
            return
        same_filter = self._shown is not None and self._shown[1] == self.filter
        if not force and same_filter and time.monotonic() - self._shown_at < LIVE_REFRESH_S:
            return  # the next poll after the interval draws it
        self._shown = key
        self._shown_at = time.monotonic()
        self.query_one("#rollout-failures", Static).update(model.failures())
        self.query_one(RolloutTable).set_rows(model.rows(self.filter, limit=MAX_ROWS))

    @on(Input.Changed, "#filter-status")
    def _on_status(self, event: Input.Changed) -> None:
        typed = event.value.strip().lower()
        status = next((s for s in STATES if typed and s.startswith(typed)), typed)
        self._set(RolloutFilter(status, self.filter.task, self.filter.min_reward))

    @on(Input.Changed, "#filter-task")
    def _on_task(self, event: Input.Changed) -> None:
        self._set(RolloutFilter(self.filter.status, event.value.strip(), self.filter.min_reward))

    @on(Input.Changed, "#filter-min-reward")
    def _on_min_reward(self, event: Input.Changed) -> None:
        self._set(RolloutFilter(self.filter.status, self.filter.task, _float_or_none(event.value.strip())))

    def _set(self, new: RolloutFilter) -> None:
        self.filter = new
        model = getattr(self.app, "model", None)
        if isinstance(model, DashboardModel):
            self.show(model)
