"""The dashboard while the circuit breaker holds admissions: the overview says why and until when."""

from __future__ import annotations

from pathlib import Path

from store.events import AdmissionsPaused, ApplianceStarted, Event, RolloutCreated, RolloutFinished
from tests.tui.conftest import fixture_app
from tests.tui.run_events import T0, write_run
from tui.model import DashboardModel, describe
from tui.widgets.overview import OverviewPanel

CAUSE = "AgentFailed: agent exit code 1\nfatal: no OPENAI_API_KEY that works"


def breaker_run(backoff_s: float = 30.0, trips: int = 1) -> list[Event]:
    events: list[Event] = [
        ApplianceStarted(
            ts=T0, run_id="run-b", model="tiny", engine="torch", resumed_from_version=0, resumed_from_step=0
        )
    ]
    for j in range(2):
        rollout = f"g000000-r{j}"
        events += [
            RolloutCreated(
                ts=T0 + 1,
                rollout=rollout,
                task_id="t",
                group="g000000",
                task={},
                policy_version=0,
                adapter="command",
            ),
            RolloutFinished(ts=T0 + 2, rollout=rollout, status="failed", error=CAUSE),
        ]
    events.append(AdmissionsPaused(ts=T0 + 3, failures=2, backoff_s=backoff_s, cause=CAUSE, trips=trips))
    return events


def model_of(events: list[Event]) -> DashboardModel:
    model = DashboardModel()
    for position, event in enumerate(events, start=1):
        model.apply(event, position)
    return model


def overview(model: DashboardModel, now: float) -> str:
    return OverviewPanel.render_text(model, now, [], True, 100).plain


def test_overview_names_the_cause_and_when_admissions_resume() -> None:
    text = overview(model_of(breaker_run()), now=T0 + 13)
    lines = text.splitlines()
    assert lines[1] == "ADMISSIONS PAUSED  2 training rollouts failed in a row; resume in 20.0s"
    assert lines[2] == "cause AgentFailed: agent exit code 1: fatal: no OPENAI_API_KEY that works"


def test_trips_in_a_row_are_counted() -> None:
    text = overview(model_of(breaker_run(backoff_s=120.0, trips=3)), now=T0 + 3)
    assert "2 training rollouts failed in a row (trip 3 in a row); resume in 2.0m" in text


def test_no_line_once_the_back_off_is_over_or_without_a_trip() -> None:
    assert "ADMISSIONS PAUSED" not in overview(model_of(breaker_run()), now=T0 + 33)
    assert "ADMISSIONS PAUSED" not in overview(model_of(breaker_run()[:-1]), now=T0 + 3)


def test_event_log_line() -> None:
    trip = breaker_run()[-1]
    assert describe(trip) == (
        "admissions paused 30 s (trip 1): 2 failed in a row; last: "
        "AgentFailed: agent exit code 1: fatal: no OPENAI_API_KEY that works"
    )


async def test_dashboard_shows_the_pause_of_a_run_read_from_its_file(tmp_path: Path) -> None:
    app = fixture_app(await write_run(tmp_path / "events.sqlite", breaker_run()))
    async with app.run_test(size=(100, 30)) as pilot:
        await app.caught_up.wait()
        await pilot.pause()
        text = str(app.query_one(OverviewPanel).render())
    # Read from its file, the dashboard shows the run at its last event: the trip itself.
    assert "ADMISSIONS PAUSED  2 training rollouts failed in a row; resume in 30.0s" in text
    assert "cause AgentFailed: agent exit code 1: fatal: no OPENAI_API_KEY that works" in text
