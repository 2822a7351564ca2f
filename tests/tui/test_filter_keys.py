"""The dashboard's keys with a filter box focused: digits and ``q`` are filter text, escape leaves
the filter (its text stays applied), ctrl+c / ctrl+q quit from anywhere, and the key line says
what works where the focus is. Pilot against the hand-built run's store."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, TabbedContent

from tests.tui.conftest import fixture_app
from tui.app import DashboardApp
from tui.widgets.keybar import KeyBar


async def loaded(pilot: Pilot[None]) -> DashboardApp:
    app = pilot.app
    assert isinstance(app, DashboardApp)
    await app.caught_up.wait()
    await pilot.pause()
    return app


def key_line(app: DashboardApp) -> str:
    return str(app.query_one("#keys", KeyBar).render())


def active_tab(app: DashboardApp) -> str:
    return app.query_one("#tabs", TabbedContent).active


async def test_a_focused_filter_takes_digits_and_q_as_text_and_escape_leaves_it(fixture_db: Path) -> None:
    app = fixture_app(fixture_db)
    async with app.run_test(size=(120, 30)) as pilot:
        await loaded(pilot)
        assert "q quit" in key_line(app) and "1 overview" in key_line(app)
        await pilot.press("3")
        task = app.query_one("#filter-task", Input)
        task.focus()
        await pilot.pause()
        assert "esc leave filter" in key_line(app) and "ctrl+q quit" in key_line(app)
        assert "q quit" not in key_line(app).replace("ctrl+q quit", "")

        await pilot.press("1", "q")
        await pilot.pause()
        assert task.value == "1q"
        assert app.is_running and active_tab(app) == "rollouts"

        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.focused, Input)
        assert app.focused is app.query_one("#rollouts-table")
        assert "q quit" in key_line(app) and "1 overview" in key_line(app)
        await pilot.press("2")
        await pilot.pause()
        assert active_tab(app) == "curves"
        assert task.value == "1q"  # the filter stays applied

        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_escape_leaves_an_event_log_filter_too(fixture_db: Path) -> None:
    app = fixture_app(fixture_db)
    async with app.run_test(size=(120, 30)) as pilot:
        await loaded(pilot)
        await pilot.press("4")
        kind = app.query_one("#log-type", Input)
        kind.focus()
        await pilot.press(*"ControlReq")
        await pilot.pause()
        assert kind.value == "ControlReq" and app.is_running
        await pilot.press("escape")
        await pilot.pause()
        assert app.focused is None
        await pilot.press("1")
        await pilot.pause()
        assert active_tab(app) == "overview"


@pytest.mark.parametrize("key", ["ctrl+c", "ctrl+q"])
async def test_ctrl_c_and_ctrl_q_quit_from_a_filter(fixture_db: Path, key: str) -> None:
    app = fixture_app(fixture_db)
    async with app.run_test(size=(120, 30)) as pilot:
        await loaded(pilot)
        await pilot.press("3")
        app.query_one("#filter-status", Input).focus()
        await pilot.pause()
        await pilot.press(key)
        await pilot.pause()
        assert not app.is_running
