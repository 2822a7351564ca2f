"""SVG snapshots of the main screens at 80x24 and 160x48, on the hand-built (deterministic) run.

Update them with ``pytest tests/tui/test_snapshots.py --snapshot-update`` after a deliberate
change of the dashboard's look; docs/screenshots/ holds copies linked from the README.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from tests.tui.conftest import fixture_app
from tui.app import DashboardApp

SIZES = [(80, 24), (160, 48)]
#: screen name -> keys pressed once the run is loaded.
SCREENS: dict[str, tuple[str, ...]] = {
    "overview": (),
    "curves": ("2",),
    "rollouts": ("3",),
    "rollout": ("3", "down", "down", "down", "down", "down", "down", "enter"),  # r-1-1, preempted
    "events": ("4",),
    "help": ("question_mark",),
}


async def loaded(pilot: Pilot[None]) -> None:
    app = pilot.app
    assert isinstance(app, DashboardApp)
    await app.caught_up.wait()
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("screen", list(SCREENS))
def test_screen(
    screen: str, size: tuple[int, int], fixture_db: Path, snap_compare: Callable[..., Any]
) -> None:
    app = fixture_app(fixture_db)
    assert snap_compare(app, press=list(SCREENS[screen]), terminal_size=size, run_before=loaded)
