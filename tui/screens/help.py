"""Keyboard help, on ``?``: every binding of the dashboard in one table."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: tuple[tuple[str, str], ...] = (
    ("1 2 3 4", "overview, curves, rollouts, event log"),
    ("tab / shift+tab", "move focus (filters, table)"),
    ("enter", "open the selected rollout"),
    ("escape", "back from a rollout / close this help / leave a filter"),
    ("p", "pause training (asks first)"),
    ("u", "resume training (asks first)"),
    ("k", "save a checkpoint now (asks first)"),
    ("s", "stop the run gracefully (asks first)"),
    ("?", "this help"),
    ("q", "quit the dashboard"),
    ("ctrl+q / ctrl+c", "quit, also from a filter (which takes 1-4 and q as text)"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        table = Table(show_header=False, box=None, padding=(0, 2))
        for key, what in KEYS:
            table.add_row(f"[bold]{key}[/]", what)
        with Vertical(id="help"):
            yield Static("[bold]lightning-appliance dashboard: keys[/]", id="help-title")
            yield Static(table)
