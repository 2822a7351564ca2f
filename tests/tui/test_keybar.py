"""The key hints line: built from the bindings, help first, hidden bindings left out."""

from __future__ import annotations

from textual.binding import Binding

from tui.app import DashboardApp
from tui.widgets.keybar import key_hints


def test_hints_follow_the_bindings_with_help_first() -> None:
    hints = key_hints(DashboardApp.BINDINGS)
    assert hints.startswith("[b]?[/b] help")
    for binding in DashboardApp.BINDINGS:
        assert isinstance(binding, Binding)
        assert f"{binding.description}" in hints


def test_hidden_and_undescribed_bindings_are_left_out_and_first_key_shown() -> None:
    hints = key_hints(
        [
            Binding("escape,backspace", "back", "back"),
            Binding("x", "secret", "secret", show=False),
            Binding("y", "nothing", ""),
        ]
    )
    assert hints == "[b]esc[/b] back"
