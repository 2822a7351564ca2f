"""Messages the dashboard posts: what tests and the app react to, as small dataclasses.

Owns the message types only; who posts and who handles them is in ``tui.app`` and the widgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message


@dataclass
class EventsApplied(Message):
    """A poll folded ``count`` new events; the model now stands at ``position``."""

    count: int
    position: int


@dataclass
class ControlSent(Message):
    """An operator action was accepted and recorded at ``position``."""

    action: str
    position: int


@dataclass
class ControlFailed(Message):
    """An operator action was not sent (declined, read-only, or refused by the appliance)."""

    action: str
    reason: str


@dataclass
class RolloutSelected(Message):
    """The rollouts table asked to open ``rollout``."""

    rollout: str


@dataclass
class SourceFailed(Message):
    """Polling the event source failed; the dashboard keeps trying."""

    error: str
