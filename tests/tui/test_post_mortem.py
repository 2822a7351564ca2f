"""The dashboard says why rollouts failed (the rollouts tab and the overview, in ``status``'s
words), and shows a stopped run as a post-mortem: the run's own figures over its life and the
recorded stop reason, no last live rates, no machine panel."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.widgets import Static

from store.events import ApplianceStarted, ApplianceStopped, ControlRequested, Event
from tests.tui.conftest import fixed_usage, fixture_app
from tests.tui.run_events import T0, run_events
from tui.model import DashboardModel
from tui.widgets.overview import OverviewPanel
from tui.widgets.rollout_table import RolloutTable


def folded(events: list[Event]) -> DashboardModel:
    model = DashboardModel()
    for position, event in enumerate(events, start=1):
        model.apply(event, position)
    return model


def overview(model: DashboardModel, live: bool) -> str:
    return str(OverviewPanel.render_text(model, model.last_ts, fixed_usage(), live, 120))


async def test_the_rollouts_tab_says_why_rollouts_failed(fixture_db: Path) -> None:
    app = fixture_app(fixture_db)
    async with app.run_test(size=(160, 48)) as pilot:
        await app.caught_up.wait()
        await pilot.press("3")
        await pilot.pause()
        summary = str(app.query_one("#rollout-failures", Static).render())
        table = app.query_one(RolloutTable)
        rows = {row.rollout: row.reason for row in table.rows}
        drawn = table.render()
        assert isinstance(drawn, Text)
    assert summary == "failed 1: timeout x1"
    assert rows["r-3-1"] == "timeout" and rows["r-3-0"] == ""
    failed_line = next(line for line in drawn.plain.splitlines() if line.startswith("r-3-1"))
    assert failed_line.rstrip().endswith("failed   -       2     8       1   2    2.5s    timeout")
    assert "failed 1: timeout x1" in overview(app.model, live=False)


def test_a_stopped_run_shows_its_life_and_no_machine() -> None:
    model = folded(run_events())
    text = overview(model, live=False)
    assert "stopped: requested" in text and "stopped: stopped" not in text
    assert "GPU 0" not in text and "calls/s" not in text
    life = model.life()
    # The run ran from its start to its stop: 17 calls of 4 tokens each over that time.
    assert life.run_s == model.last_ts - T0
    assert (life.calls, life.sampled, life.steps) == (17, 68, 2)
    assert f"calls 17 ({17 / life.run_s:.2f}/s)" in text and "steps 2" in text
    assert "reward 0.500 → 0.750" in text and "validation 0.600 → 0.800" in text
    # While live the same run shows its recent rates and the machine.
    live = overview(folded(run_events()[:-1]), live=True)
    assert "calls/s" in live and "GPU 0 mem 12.5/80.0 GiB" in live and "ran " not in live


def test_the_stop_reason_is_said_once_with_its_cause() -> None:
    start = ApplianceStarted(
        ts=T0, run_id="r", model="tiny", engine="torch", resumed_from_version=0, resumed_from_step=0
    )
    plain = folded([start, ApplianceStopped(ts=T0 + 10, reason="stopped")])
    assert plain.stop_text() == "stopped"
    assert "stopped: stopped" not in overview(plain, live=False)
    asked = folded(
        [
            start,
            ControlRequested(ts=T0 + 5, action="stop", source="dashboard"),
            ApplianceStopped(ts=T0 + 10, reason="stop requested"),
        ]
    )
    assert asked.stop_text() == "stopped: stop requested (dashboard)"
    # Two starts: the time between a stop and the next start is not the run's.
    again = folded(
        [
            start,
            ApplianceStopped(ts=T0 + 10, reason="reached step 1"),
            ApplianceStarted(
                ts=T0 + 100,
                run_id="r",
                model="tiny",
                engine="torch",
                resumed_from_version=1,
                resumed_from_step=1,
            ),
            ApplianceStopped(ts=T0 + 130, reason="reached step 2"),
        ]
    )
    assert again.life().run_s == 40.0 and again.stop_text() == "stopped: reached step 2"
