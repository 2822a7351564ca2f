"""The key hints at the bottom of each screen.

Owns :class:`KeyBar`: a line built once from a screen's bindings, and a second one for while a
text box (a filter) has the focus. Textual's ``Footer`` recomposes itself on every focus change
(each tab switch), which cost most of a key press's redraw time; the bindings here never change
while a screen is shown, so two fixed lines are enough, swapped only when the focus moves into
or out of a text box.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.markup import escape
from textual.binding import Binding, BindingType
from textual.widgets import Static

#: How a binding's key is shown where its name is not what a person types.
KEY_LABELS = {"question_mark": "?", "escape": "esc", "enter": "enter"}


def key_hints(bindings: Iterable[BindingType]) -> str:
    """``key description`` pairs of the bindings that show, as Rich markup on one line."""
    parts = []
    # Help first: on a narrow terminal the line is cut at the right edge, and ``?`` lists the rest.
    ordered = sorted(bindings, key=lambda b: not (isinstance(b, Binding) and b.key == "question_mark"))
    for binding in ordered:
        if not isinstance(binding, Binding) or not binding.show or not binding.description:
            continue
        first = binding.key.split(",")[0].strip()
        key = KEY_LABELS.get(first, first)
        parts.append(f"[b]{escape(key)}[/b] {escape(binding.description)}")
    return "  ".join(parts)


class KeyBar(Static):
    """One line of key hints, docked at the bottom: the screen's keys, or, while a text box has
    the focus (it takes every printable key as text), the keys that work there (``in_input``)."""

    DEFAULT_CSS = """
    KeyBar {
        dock: bottom;
        height: 1;
        background: $panel;
        color: $text-muted;
        padding: 0 1;
    }
    """

    def __init__(
        self,
        bindings: Iterable[BindingType],
        *,
        id: str | None = None,
        in_input: Iterable[BindingType] | None = None,
    ) -> None:
        self.hints = key_hints(bindings)
        self.input_hints = key_hints(in_input) if in_input is not None else self.hints
        self.in_input = False
        super().__init__(self.hints, id=id)

    def show_keys(self, *, in_input: bool) -> None:
        """Show the keys of a text box (``in_input``) or the screen's; redrawn only on a change."""
        if in_input != self.in_input:
            self.in_input = in_input
            self.update(self.input_hints if in_input else self.hints)
