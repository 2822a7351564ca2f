"""The event log tail, filtered by event type (a case-insensitive part of the name) and by text.

Owns the filter inputs and drawing the last lines that fit; the lines come from
``DashboardModel.tail``.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Static

from store.events import EVENT_TYPES
from tui.model import DashboardModel

TYPE_STYLE = {
    "LLMCallCompleted": "cyan",
    "RewardReported": "green",
    "RolloutFinished": "green",
    "TrainStepCompleted": "magenta",
    "PolicyVersionPublished": "magenta",
    "PhaseChanged": "yellow",
    "SwitchPhaseCompleted": "yellow",
    "ControlRequested": "bold red",
    "CheckpointSaved": "blue",
    "ValidationCompleted": "blue",
}


class EventLogPanel(Vertical):
    """Filters on top, the newest matching events below (the newest last)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.type_filter = ""
        self.text_filter = ""
        self._shown: tuple[int, str, str, int] | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="log-filters"):
            yield Input(placeholder="event type, e.g. TrainStep", id="log-type")
            yield Input(placeholder="text contains", id="log-text")
        yield Static(id="log-lines")

    def show(self, model: DashboardModel) -> None:
        lines_widget = self.query_one("#log-lines", Static)
        height = max(lines_widget.size.height, 1)
        key = (model.revision, self.type_filter, self.text_filter, height)
        if key == self._shown:
            return
        self._shown = key
        needle = self.type_filter.lower()
        types = [t for t in EVENT_TYPES if needle in t.lower()] if needle else []
        if needle and not types:
            types = ["<none>"]
        text = Text(no_wrap=True, overflow="ellipsis")
        lines = model.tail(types, self.text_filter, limit=height)
        for i, line in enumerate(lines):
            clock = time.strftime("%H:%M:%S", time.gmtime(line.ts))
            text.append(f"{line.position:>7} {clock} ", style="dim")
            text.append(f"{line.type[:22]:<22} ", style=TYPE_STYLE.get(line.type, ""))
            if line.rollout:
                text.append(f"{line.rollout[:10]} ", style="dim")
            text.append(line.text)
            if i < len(lines) - 1:
                text.append("\n")
        if not lines:
            text.append("no matching events", style="dim")
        lines_widget.update(text)

    @on(Input.Changed, "#log-type")
    def _on_type(self, event: Input.Changed) -> None:
        self.type_filter = event.value.strip()
        self._refilter()

    @on(Input.Changed, "#log-text")
    def _on_text(self, event: Input.Changed) -> None:
        self.text_filter = event.value.strip()
        self._refilter()

    def _refilter(self) -> None:
        model = getattr(self.app, "model", None)
        if isinstance(model, DashboardModel):
            self.show(model)
