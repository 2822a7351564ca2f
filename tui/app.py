"""The dashboard application: tabs, key bindings, the polling worker, and operator controls.

Owns wiring an :class:`~tui.source.EventSource` to a :class:`~tui.model.DashboardModel` and the
widgets: a worker polls the source, folds new events into the model, and redraws only the tab on
screen (at most a few times a second, so a busy log never starves key presses). Controls ask for
confirmation and go through a :class:`~tui.source.ControlClient`; a read-only run has none, and
says so. Posts the messages of ``tui.messages``. Build it with :func:`DashboardApp` directly; the
CLI (``appliance.cli``) decides the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, Protocol

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Header, Input, TabbedContent, TabPane

from contracts.errors import ApplianceError
from tui.detail import Decoder, rollout_detail, tokenizer_decoder
from tui.messages import ControlFailed, ControlSent, EventsApplied, RolloutSelected, SourceFailed
from tui.model import DashboardModel
from tui.screens.confirm import ConfirmScreen
from tui.screens.help import HelpScreen
from tui.screens.rollout import RolloutScreen
from tui.source import PAGE, EventSource
from tui.system import SystemSampler, Usage
from tui.widgets.curves import CurvesPanel
from tui.widgets.eventlog import EventLogPanel
from tui.widgets.keybar import KeyBar
from tui.widgets.overview import OverviewPanel
from tui.widgets.rollouts import RolloutsPanel

TABS = ("overview", "curves", "rollouts", "events")
QUESTIONS = {
    "pause": "Pause training? No new rollouts or steps start; calls in flight finish.",
    "resume": "Resume training?",
    "checkpoint": "Save a checkpoint now?",
    "stop": "Stop the run gracefully? (finishes the current step, saves, exits)",
}
#: Seconds between redraws while a backlog is being read.
REDRAW_EVERY_S = 0.5


class ControlSender(Protocol):
    async def send(self, action: str) -> int: ...


#: Events folded between two turns of the event loop while following the log.
FOLD_SLICE = 32


class DashboardApp(App[None]):
    """The lightning-appliance dashboard."""

    #: Absolute, so that subclasses elsewhere (benchmarks) find it too.
    CSS_PATH = Path(__file__).with_name("dashboard.tcss")
    TITLE = "lightning-appliance"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "show_tab('overview')", "overview"),
        Binding("2", "show_tab('curves')", "curves"),
        Binding("3", "show_tab('rollouts')", "rollouts"),
        Binding("4", "show_tab('events')", "events"),
        Binding("p", "control('pause')", "pause"),
        Binding("u", "control('resume')", "resume"),
        Binding("k", "control('checkpoint')", "checkpoint"),
        Binding("s", "control('stop')", "stop"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        # A filter box takes every printable key as text ("1", "q", "ControlRequested"): escape
        # leaves it, and ctrl+c quits from anywhere (ctrl+q too, Textual's own priority binding).
        Binding("escape", "leave_filter", show=False),
        Binding("ctrl+c", "quit", show=False, priority=True),
    ]
    #: The key line while a filter box has focus: what works there.
    FILTER_KEYS: ClassVar[list[BindingType]] = [
        Binding("escape", "leave_filter", "leave filter (then 1-4, q, ...)"),
        Binding("tab", "focus_next", "next field"),
        Binding("ctrl+q", "quit", "quit"),
    ]

    def __init__(
        self,
        source: EventSource,
        *,
        control: ControlSender | None = None,
        clock: Callable[[], float] = time.time,
        usage: Callable[[], list[Usage]] | None = None,
        decoder: Decoder | None = None,
        find_tokenizer: bool = True,
        data_dir: Path | None = None,
        poll_interval_s: float = 0.25,
        usage_interval_s: float = 2.0,
        freeze_gc: bool = False,
    ) -> None:
        super().__init__()
        #: Move folded events out of the cyclic collector's reach after each batch. Only for a
        #: dashboard in its own process (``tui``): inside ``up`` it would also pin whatever
        #: cyclic garbage the appliance holds at that moment, for the life of the run.
        self.freeze_gc = freeze_gc
        self.source = source
        self.control = control
        self.model = DashboardModel()
        self.clock = clock
        self.sampler = usage or SystemSampler().sample
        self.usage: list[Usage] = []
        self.decoder = decoder
        self._find_tokenizer = find_tokenizer and decoder is None
        self.data_dir = data_dir
        self.poll_interval_s = poll_interval_s
        self.usage_interval_s = usage_interval_s
        #: Set once the source's backlog has been read (the dashboard shows the run as it stands).
        self.caught_up = asyncio.Event()
        self.sub_title = source.label
        self._last_redraw = 0.0

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(id="tabs", initial="overview"):
            with TabPane("1 Overview", id="overview"):
                yield OverviewPanel(id="overview-panel")
            with TabPane("2 Curves", id="curves"):
                yield CurvesPanel(id="curves-panel")
            with TabPane("3 Rollouts", id="rollouts"):
                yield RolloutsPanel(id="rollouts-panel")
            with TabPane("4 Events", id="events"):
                yield EventLogPanel(id="events-panel")
        yield KeyBar(self.BINDINGS, id="keys", in_input=self.FILTER_KEYS)

    async def on_mount(self) -> None:
        self.watch(self.screen, "focused", self._focus_moved)
        # This machine's usage is the run's only while the run is live (``up``, ``tui --url``);
        # a run opened from its file shows its own figures instead (``OverviewPanel``).
        if self.source.live:
            self.usage = await asyncio.to_thread(self.sampler)
        self._follow()
        if self.source.live and self.usage_interval_s > 0:
            self.set_interval(self.usage_interval_s, self._sample_usage)

    async def on_unmount(self) -> None:
        await self.source.close()

    # --- following the log -------------------------------------------------------------------

    def now(self) -> float:
        """Wall time for a live run; the last event's time for a finished one (deterministic)."""
        return self.clock() if self.source.live else self.model.last_ts

    @work(exclusive=True, group="follow")
    async def _follow(self) -> None:
        failing = False
        while True:
            try:
                events = await self.source.poll(self.model.position, PAGE)
            except Exception as exc:  # the appliance went away, a locked file: keep trying
                if not failing:
                    self.post_message(SourceFailed(str(exc)))
                    self.notify(f"cannot read events: {exc}", severity="error", timeout=5)
                failing = True
                await asyncio.sleep(1.0)
                continue
            failing = False
            if events:
                # Folded a slice at a time, yielding to the event loop in between, so that a key
                # press waits for one slice at most, not for a whole page of events.
                for start in range(0, len(events), FOLD_SLICE):
                    self.model.extend(events[start : start + FOLD_SLICE])
                    await asyncio.sleep(0)
                # The folded events live as long as the dashboard: move them out of the cyclic
                # collector's generations, so that a full collection never pauses a key press.
                if self.freeze_gc:
                    gc.freeze()
                self.post_message(EventsApplied(len(events), self.model.position))
            backlog = len(events) >= PAGE
            if not backlog:
                self.caught_up.set()
            if events and (not backlog or time.monotonic() - self._last_redraw > REDRAW_EVERY_S):
                self.redraw()
            await asyncio.sleep(0 if backlog else self.poll_interval_s)

    async def _sample_usage(self) -> None:
        self.usage = await asyncio.to_thread(self.sampler)
        if self.query_one("#tabs", TabbedContent).active == "overview":
            self.redraw()

    def redraw(self) -> None:
        """Draw the tab on screen from the model (the others draw when they are shown)."""
        self._last_redraw = time.monotonic()
        # NoMatches: the tab's widgets are not mounted yet (start-up, shutdown); the next one draws.
        with contextlib.suppress(NoMatches):
            self._redraw(self.query_one("#tabs", TabbedContent).active)

    def _redraw(self, active: str) -> None:
        if active == "overview":
            self.query_one(OverviewPanel).show(self.model, self.now(), self.usage, self.source.live)
        elif active == "curves":
            self.query_one(CurvesPanel).show(self.model)
        elif active == "rollouts":
            self.query_one(RolloutsPanel).show(self.model)
        elif active == "events":
            self.query_one(EventLogPanel).show(self.model)

    @on(TabbedContent.TabActivated)
    def _tab_activated(self) -> None:
        self.call_after_refresh(self.redraw)

    def on_resize(self) -> None:
        self.call_after_refresh(self.redraw)

    def _focus_moved(self, focused: Widget | None) -> None:
        """The key line says what works where the focus now is (a filter box, or anywhere else)."""
        with contextlib.suppress(NoMatches):
            self.query_one("#keys", KeyBar).show_keys(in_input=isinstance(focused, Input))

    # --- actions -----------------------------------------------------------------------------

    def action_leave_filter(self) -> None:
        """Escape in a filter box: its text stays applied, the focus moves on (to the rollouts
        table, or nowhere), so that the dashboard's keys work again."""
        focused = self.screen.focused
        if not isinstance(focused, Input):
            return
        if self.query_one("#tabs", TabbedContent).active == "rollouts":
            self.query_one("#rollouts-table").focus()
        else:
            self.screen.set_focus(None)

    def action_show_tab(self, tab: str) -> None:
        if tab in TABS:
            while isinstance(self.screen, RolloutScreen):
                self.pop_screen()
            self.query_one("#tabs", TabbedContent).active = tab
            self.redraw()
            if tab == "rollouts":
                self.query_one("#rollouts-table").focus()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_control(self, action: str) -> None:
        if self.control is None or not self.source.live:
            reason = "read-only: this run is opened from its file; controls are disabled"
            self.notify(reason, severity="warning")
            self.post_message(ControlFailed(action, reason))
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self._send_control(action)
            else:
                self.post_message(ControlFailed(action, "declined"))

        self.push_screen(ConfirmScreen(QUESTIONS[action]), answered)

    @work(group="control")
    async def _send_control(self, action: str) -> None:
        assert self.control is not None
        try:
            position = await self.control.send(action)
        except Exception as exc:
            reason = getattr(exc, "message", str(exc))
            self.notify(f"{action} failed: {reason}", severity="error", timeout=8)
            self.post_message(ControlFailed(action, reason))
            return
        self.notify(f"{action} requested (event {position})")
        self.post_message(ControlSent(action, position))

    @on(RolloutSelected)
    async def _open_rollout(self, message: RolloutSelected) -> None:
        view = self.model.state.rollouts.get(message.rollout)
        if view is None:
            return
        if self._find_tokenizer:
            self._find_tokenizer = False
            self.decoder = await asyncio.to_thread(
                tokenizer_decoder, self.model.config, self.model.model, self.data_dir
            )
        if view.released:  # trained on: the state dropped its calls, the log has them
            try:
                view = replace(view, calls=await self.source.calls(view.rollout), released=False)
            except ApplianceError as exc:
                self.notify(f"cannot read the calls of {view.rollout}: {exc}", severity="error")
        await self.push_screen(RolloutScreen(rollout_detail(view, self.decoder)))
