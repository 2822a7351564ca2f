"""The dashboard driven with Pilot against the store of a real two-step run.

Every screen and control: overview, curves, rollouts (filters, detail with token segments), event
log (filters), help, controls (read-only refusal; confirm and send through the real appliance's
``POST /admin/control``), asserting on what is drawn and on the messages posted.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from textual.message import Message
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static

from appliance.app import Appliance
from appliance.cli.tui import tui_app
from store.events import ControlRequested, TrainStepCompleted
from store.eventstore import read_calls_sync, read_events_sync
from tests.support import make_config
from tests.tui.conftest import RealRun, fixed_usage
from trainer.samples import build_samples
from tui.app import DashboardApp
from tui.messages import ControlFailed, ControlSent, EventsApplied
from tui.screens.confirm import ConfirmScreen
from tui.screens.help import HelpScreen
from tui.screens.rollout import RolloutScreen
from tui.source import ControlClient, HttpSource
from tui.widgets.curves import CurvePlot
from tui.widgets.overview import OverviewPanel
from tui.widgets.rollout_table import RolloutTable


def read_only_app(real_run: RealRun) -> DashboardApp:
    """What ``lightning-appliance tui --db <run>/events.sqlite`` builds."""
    args = argparse.Namespace(db=real_run.db, url=None, token=None, data_dir=real_run.data_dir)
    app = tui_app(args)
    app.sampler = fixed_usage
    return app


async def until(pilot: Pilot[None], condition: Callable[[], bool], tries: int = 400) -> None:
    """Let the app run until ``condition`` holds (at most ``tries`` short pauses)."""
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.025)
    raise AssertionError("the dashboard never reached the expected state")


async def confirm(pilot: Pilot[None], key: str, messages: list[Message]) -> None:
    """Press a control key, check it asks, say yes, and wait until it was sent."""
    sent_before = sum(isinstance(m, ControlSent) for m in messages)
    await pilot.press(key)
    await pilot.pause()
    assert isinstance(pilot.app.screen, ConfirmScreen)
    await pilot.press("y")
    await until(pilot, lambda: sum(isinstance(m, ControlSent) for m in messages) > sent_before)


def text_of(widget: Static) -> str:
    return str(widget.render())


async def test_overview_shows_the_run_as_it_ended(real_run: RealRun) -> None:
    messages: list[Message] = []
    app = read_only_app(real_run)
    events = read_events_sync(real_run.db)
    async with app.run_test(size=(100, 30), message_hook=messages.append) as pilot:
        await app.caught_up.wait()
        await pilot.pause()
        text = text_of(app.query_one(OverviewPanel))
    applied = [m for m in messages if isinstance(m, EventsApplied)]
    assert applied and applied[-1].position == events[-1].position
    assert sum(m.count for m in applied) == len(events)
    assert "policy v2" in text and "step 2" in text
    assert "finished 8" in text and "failed 0" in text
    assert "stopped: reached step 2" in text
    # A post-mortem: the run's own figures over its life, not this machine's nor the last rates.
    assert "GPU 0" not in text and "calls/s" not in text
    assert f"calls {app.model.life().calls} (" in text and "steps 2" in text
    for phase in ("gen ", "switch ", "train "):
        assert phase in text


async def test_curves_plot_every_step_of_the_run(real_run: RealRun) -> None:
    steps = [s.event for s in read_events_sync(real_run.db) if isinstance(s.event, TrainStepCompleted)]
    app = read_only_app(real_run)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.caught_up.wait()
        await pilot.press("2")
        await pilot.pause()
        assert app.query_one("#tabs").active == "curves"  # type: ignore[attr-defined]
        loss = app.query_one("#curve-loss", CurvePlot)
        reward = app.query_one("#curve-reward_mean", CurvePlot)
        assert loss.points == [(s.step, s.metrics["loss"]) for s in steps]
        assert reward.points == [(s.step, s.metrics["reward_mean"]) for s in steps]
        drawn = str(loss.render())
    assert "@ step 2" in drawn and "step 1 … 2" in drawn
    assert any("\u2800" < ch <= "\u28ff" for ch in drawn), "the curve is drawn in braille"


async def test_rollouts_table_filters_and_opens_a_rollout(real_run: RealRun) -> None:
    app = read_only_app(real_run)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.caught_up.wait()
        await pilot.press("3")
        await pilot.pause()
        table = app.query_one("#rollouts-table", RolloutTable)
        assert table.row_count == 8
        state = app.model.state

        app.query_one("#filter-status", Input).value = "fail"
        await pilot.pause()
        assert table.row_count == 0
        app.query_one("#filter-status", Input).value = ""
        await pilot.pause()
        assert table.row_count == 8

        task = next(iter(state.rollouts.values())).task_id
        app.query_one("#filter-task", Input).value = task
        await pilot.pause()
        expected = [v.rollout for v in reversed(state.rollouts.values()) if task in v.task_id]
        assert [row.rollout for row in table.rows] == expected
        app.query_one("#filter-task", Input).value = ""
        app.query_one("#filter-min-reward", Input).value = "0.5"
        await pilot.pause()
        rewarded = [v for v in state.rollouts.values() if v.reward is not None and v.reward >= 0.5]
        assert table.row_count == len(rewarded)
        app.query_one("#filter-min-reward", Input).value = ""
        await pilot.pause()

        table.focus()
        await pilot.press("end", "home", "enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RolloutScreen)
        detail = screen.detail
        view = detail.view
        assert view.rollout == table.rows[0].rollout
        # Trained on, so the dashboard's state dropped its calls: the screen read them from the log.
        assert app.model.state.rollouts[view.rollout].released and not view.released
        assert view.calls == read_calls_sync(real_run.db, view.rollout) and view.calls
        # Decoded with the run's tokenizer, found from the recorded config.
        assert detail.text_source == "tokenizer"
        (sample,) = build_samples(view.calls)
        assert sum(len(s.tokens) for s in detail.segments) == len(sample.tokens)
        sampled = [s for s in detail.segments if s.loss_mask]
        assert sum(len(s.tokens) for s in sampled) == sample.num_sampled
        assert {s.version for s in sampled} == {c.policy_version for c in view.calls}
        segments_text = text_of(screen.query_one("#rollout-segments", Static))
        assert f"sampled v{sampled[0].version}" in segments_text and "prompt mask 0" in segments_text
        calls_table = screen.query_one("#rollout-calls", DataTable)
        assert calls_table.row_count == len(view.calls)
        summary = text_of(screen.query_one("#rollout-summary", Static))
        assert f"reward {view.reward:+.3f}" in summary
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, RolloutScreen)


async def test_event_log_filters_by_type_and_text(real_run: RealRun) -> None:
    app = read_only_app(real_run)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.caught_up.wait()
        await pilot.press("4")
        await pilot.pause()
        log = app.query_one("#log-lines", Static)
        assert "ApplianceStopped" in text_of(log)  # the newest event is at the bottom
        app.query_one("#log-type", Input).value = "trainstep"
        await pilot.pause()
        lines = text_of(log).splitlines()
        assert len(lines) == 2
        assert all("TrainStepCompleted" in line for line in lines)
        app.query_one("#log-text", Input).value = "step 2:"
        await pilot.pause()
        (line,) = text_of(log).splitlines()
        assert "step 2:" in line


async def test_help_lists_the_keys(real_run: RealRun) -> None:
    app = read_only_app(real_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


async def test_controls_are_refused_on_a_finished_run(real_run: RealRun) -> None:
    messages: list[Message] = []
    app = read_only_app(real_run)
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        for key in "puks":
            await pilot.press(key)
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmScreen)
    failed = [m for m in messages if isinstance(m, ControlFailed)]
    assert [m.action for m in failed] == ["pause", "resume", "checkpoint", "stop"]
    assert all("read-only" in m.reason for m in failed)


async def test_controls_ask_then_reach_the_appliance(tmp_path: Path, tiny_model_dir: Path) -> None:
    messages: list[Message] = []
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        url, token = appliance.proxy_url, appliance.admin_token
        app = DashboardApp(
            HttpSource(url, token), control=ControlClient(url, token), usage=fixed_usage, poll_interval_s=0.05
        )
        async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
            await app.caught_up.wait()
            await pilot.press("s")  # stop: asked, declined
            await pilot.pause()
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")
            await pilot.pause()
            await confirm(pilot, "p", messages)  # pause: asked, confirmed
            await confirm(pilot, "k", messages)  # checkpoint
            # The dashboard sees its own events come back through the feed.
            await until(pilot, lambda: len(app.model.controls) == 2)
            overview = text_of(app.query_one(OverviewPanel))
        stored = [
            (s.position, s.event)
            for s in await appliance.store.read()
            if isinstance(s.event, ControlRequested)
        ]
    assert [(e.action, e.source) for _, e in stored] == [
        ("pause", "dashboard"),
        ("checkpoint", "dashboard"),
    ]
    sent = [m for m in messages if isinstance(m, ControlSent)]
    assert [(m.action, m.position) for m in sent] == [(e.action, position) for position, e in stored]
    declined = [m for m in messages if isinstance(m, ControlFailed)]
    assert [(m.action, m.reason) for m in declined] == [("stop", "declined")]
    assert "PAUSED" in overview and "last control checkpoint (dashboard)" in overview


async def test_read_only_shows_what_live_showed(real_run: RealRun) -> None:
    """Opening the finished run's file gives the same curves and rollouts as following it live."""
    app = read_only_app(real_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.caught_up.wait()
        await pilot.pause()
        from_file = app.model
    assert from_file.curves == real_run.live.curves
    assert from_file.curves["loss"] and len(from_file.curves["reward_mean"]) == 2
    assert from_file.rows() == real_run.live.rows()
    assert len(from_file.rows()) == 8
    control = from_file.controls[0]
    assert (control.action, control.source) == ("checkpoint", "dashboard")
