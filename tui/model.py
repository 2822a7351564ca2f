"""The dashboard's view-model: everything it shows, folded from the event log.

Owns :class:`DashboardModel`, a pure fold over stored events (no I/O, no Textual, no clock of its
own): the run's :class:`~store.projections.RunState` plus what the dashboard needs beyond it, the
phase timeline (generate / switch / train with durations), the training curves, call and token
rates, rollout rows with their filters, and the event-log tail. Widgets read it; they never fold.

Invariant: the model is a function of the events applied. Anything time-dependent (rates, the
open phase's duration) takes ``now`` as an argument, so a finished run read from its file shows
the same figures as it did live at its last event, and snapshots are deterministic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from store import events
from store.codec import StoredEvent
from store.outcomes import failures_text, reason_of, state_of
from store.projections import RolloutView, RunState, one_line
from store.token_figures import step_tokens, tokens_text

#: Curves the dashboard plots: (title, metric key in TrainStepCompleted.metrics).
CURVES: tuple[tuple[str, str], ...] = (
    ("reward (train)", "reward_mean"),
    ("loss", "loss"),
    ("entropy", "entropy"),
    ("KL (old || policy)", "ppo_kl"),
    ("grad norm", "grad_norm"),
    ("clip fraction", "pg_clipfrac"),
)
#: Key of the validation reward curve (from ValidationCompleted).
VALIDATION = "validation_reward"
#: Seconds of event time over which calls/s and tokens/s are measured.
RATE_WINDOW_S = 30.0
#: Lines of event log kept for the tail.
LOG_LINES = 2000
#: Phase spans kept for the timeline.
TIMELINE_SPANS = 200


@dataclass(slots=True)
class PhaseSpan:
    """One stretch of the timeline: ``generate``, ``switch``, ``train`` or ``idle``."""

    phase: str
    start: float
    #: None while it is the current phase.
    end: float | None = None

    def duration(self, now: float) -> float:
        return max(0.0, (self.end if self.end is not None else now) - self.start)


@dataclass(frozen=True, slots=True)
class LogLine:
    """One event of the log tail, as text."""

    position: int
    ts: float
    type: str
    rollout: str
    text: str


@dataclass(frozen=True, slots=True)
class RolloutRow:
    """One row of the rollouts table."""

    rollout: str
    task_id: str
    group: str
    #: The rollout's state as every view names it (``store.outcomes.state_of``).
    status: str
    purpose: str
    calls: int
    #: Tokens the policy sampled for its calls (``store.token_figures``).
    sampled: int
    reward: float | None
    version: int
    trained_step: int | None
    duration_s: float | None
    #: Why it failed, on one line ("" unless it did: ``store.outcomes.reason_of``).
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RolloutFilter:
    """Filters of the rollouts table; empty fields match everything."""

    status: str = ""
    task: str = ""
    #: Inclusive reward bounds; a rollout without a reward fails any bound.
    min_reward: float | None = None
    max_reward: float | None = None

    def matches(self, row: RolloutRow) -> bool:
        if self.status and row.status != self.status:
            return False
        if self.task and self.task.lower() not in row.task_id.lower():
            return False
        if self.min_reward is not None and (row.reward is None or row.reward < self.min_reward):
            return False
        return self.max_reward is None or (row.reward is not None and row.reward <= self.max_reward)


@dataclass(slots=True)
class Counts:
    """Rollouts by state, as ``status`` counts them (``store.outcomes.STATES``)."""

    #: Offered to external runners, not claimed yet.
    offered: int = 0
    running: int = 0
    finished: int = 0
    failed: int = 0
    #: Finished train rollouts no step has consumed yet.
    awaiting_training: int = 0


@dataclass(frozen=True, slots=True)
class LifeFigures:
    """A run's own figures over its life, for a run that is not live (``tui --db``) or has
    stopped: totals, and mean rates over the time the appliance ran (from each start to its
    stop, or to the last event of a start that recorded none)."""

    run_s: float
    calls: int
    #: Tokens sampled for the calls and trained on by the steps (``store.token_figures``).
    sampled: int
    trained: int
    steps: int
    #: (first, last) training reward (the steps' ``reward_mean``), None before a step.
    reward: tuple[float, float] | None
    #: (first, last) validation reward, None before a round.
    validation: tuple[float, float] | None

    @property
    def calls_s(self) -> float:
        return self.calls / self.run_s if self.run_s > 0 else 0.0

    @property
    def tokens_s(self) -> float:
        return self.sampled / self.run_s if self.run_s > 0 else 0.0


@dataclass
class DashboardModel:
    """The run as the dashboard shows it. Feed it events with :meth:`apply`/:meth:`extend`."""

    state: RunState = field(default_factory=RunState)
    model: str = ""
    engine: str = ""
    config: dict[str, object] = field(default_factory=dict)
    #: Where the agents run (``ApplianceStarted.agents``: sandboxed, or "agents run unsandboxed").
    agents: str = ""
    stopped: str = ""
    timeline: deque[PhaseSpan] = field(default_factory=lambda: deque(maxlen=TIMELINE_SPANS))
    #: metric key -> [(step, value)], in step order.
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    log: deque[LogLine] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    controls: list[events.ControlRequested] = field(default_factory=list)
    #: ts of the first and the last event applied.
    first_ts: float = 0.0
    last_ts: float = 0.0
    #: (ts, response tokens) of recent calls, for rates.
    _recent_calls: deque[tuple[float, int]] = field(default_factory=deque)
    _created_ts: dict[str, float] = field(default_factory=dict)
    _durations: dict[str, float] = field(default_factory=dict)
    #: Seconds the appliance ran in starts that have stopped; the one running began at
    #: ``_started_ts`` (0: none is).
    _ran_s: float = 0.0
    _started_ts: float = 0.0
    _previous_ts: float = 0.0
    #: Who asked for the stop of the current start (``ControlRequested`` "stop"), if anyone.
    _stop_source: str = ""
    #: Bumped on every change: widgets redraw only when it moved.
    revision: int = 0

    @property
    def position(self) -> int:
        return self.state.position

    def extend(self, events: Iterable[StoredEvent]) -> int:
        """Apply events in order; returns how many were applied."""
        n = 0
        for stored in events:
            self.apply(stored.event, stored.position)
            n += 1
        return n

    def apply(self, event: events.Event, position: int = 0) -> None:
        self.state.apply(event, position)
        self.revision += 1
        ts = event.ts
        if not self.first_ts:
            self.first_ts = ts
        self.last_ts = max(self.last_ts, ts)
        match event:
            case events.ApplianceStarted():
                if event.command == "up":  # an evaluation's start is not the run's
                    self.model, self.engine, self.config, self.stopped = (
                        event.model,
                        event.engine,
                        event.config,
                        "",
                    )
                    self.agents = event.agents
                if self._started_ts:  # the previous start recorded no stop: it ran until its last event
                    self._ran_s += max(0.0, self._previous_ts - self._started_ts)
                self._started_ts, self._stop_source = ts, ""
            case events.ApplianceStopped():
                if event.command == "up":  # an evaluation's stop leaves the run's reason
                    self.stopped = event.reason
                self._open("idle", ts)
                if self._started_ts:
                    self._ran_s += max(0.0, ts - self._started_ts)
                    self._started_ts = 0.0
            case events.PhaseChanged():
                self._open("switch" if event.phase == "train" else event.phase, ts)
            case events.SwitchPhaseCompleted():
                self._switch_phase(event)
            case events.LLMCallCompleted():
                self._recent_calls.append((ts, len(event.response_ids)))
                while self._recent_calls and self._recent_calls[0][0] < ts - RATE_WINDOW_S:
                    self._recent_calls.popleft()
            case events.RolloutCreated():
                self._created_ts[event.rollout] = ts
            case events.RolloutFinished():
                start = self._created_ts.get(event.rollout)
                self._durations[event.rollout] = event.duration_s or (ts - start if start else 0.0)
            case events.TrainStepCompleted():
                for _, key in CURVES:
                    if key in event.metrics:
                        self.curves.setdefault(key, []).append((event.step, float(event.metrics[key])))
            case events.ValidationCompleted():
                self.curves.setdefault(VALIDATION, []).append((event.step, event.reward_mean))
            case events.ControlRequested():
                self.controls.append(event)
                if event.action == "stop":
                    self._stop_source = event.source
            case _:
                pass
        self._previous_ts = ts
        self.log.append(LogLine(position, ts, event.type, event.rollout_id or "", describe(event)))

    # --- timeline ------------------------------------------------------------------------------

    def _open(self, phase: str, ts: float) -> None:
        current = self.timeline[-1] if self.timeline else None
        if current is not None and current.end is None:
            if current.phase == phase:
                return
            current.end = ts
        self.timeline.append(PhaseSpan(phase, ts))

    def _switch_phase(self, event: events.SwitchPhaseCompleted) -> None:
        start = event.ts - event.duration_s
        if event.phase == "train":
            current = self.timeline[-1] if self.timeline else None
            if current is not None and current.end is None:
                current.end = max(current.start, start)
            self.timeline.append(PhaseSpan("train", start, event.ts))
        elif not self.timeline or self.timeline[-1].phase != "switch" or self.timeline[-1].end is not None:
            if self.timeline and self.timeline[-1].end is None:
                self.timeline[-1].end = start
            self.timeline.append(PhaseSpan("switch", start))

    # --- figures -------------------------------------------------------------------------------

    def counts(self) -> Counts:
        counts = Counts()
        for view in self.state.rollouts.values():
            state = state_of(view)
            if state == "offered":
                counts.offered += 1
            elif state == "running":
                counts.running += 1
            elif state == "failed":
                counts.failed += 1
            else:
                counts.finished += 1
                if view.purpose == "train" and view.trained_step is None:
                    counts.awaiting_training += 1
        return counts

    def failures(self) -> str:
        """The failed rollouts with their grouped reasons, as ``status`` says it:
        ``failed 5: timed out after 120 s x5`` (``store.outcomes``)."""
        return failures_text(v for v in self.state.rollouts.values() if state_of(v) == "failed")

    def stop_text(self) -> str:
        """Why the run stopped, once: ``stopped: reached step 2``, ``stopped: stop requested
        (dashboard)``, ``stopped`` when nothing more was recorded; "" while it has not."""
        if not self.stopped:
            return ""
        reason = "" if self.stopped == "stopped" else self.stopped
        if self._stop_source and reason in ("", "stop requested"):
            reason = f"stop requested ({self._stop_source})"
        return "stopped" + (f": {reason}" if reason else "")

    def life(self) -> LifeFigures:
        """The run's own figures over its life (see :class:`LifeFigures`)."""
        running = max(0.0, self.last_ts - self._started_ts) if self._started_ts else 0.0
        rewards = self.curves.get("reward_mean", [])
        validation = self.curves.get(VALIDATION, [])
        return LifeFigures(
            run_s=self._ran_s + running,
            calls=sum(v.call_count for v in self.state.rollouts.values()),
            sampled=sum(v.tokens_sampled for v in self.state.rollouts.values()),
            trained=sum(int(s.metrics.get("tokens_trained", 0)) for s in self.state.steps),
            steps=len(self.state.steps),
            reward=(rewards[0][1], rewards[-1][1]) if rewards else None,
            validation=(validation[0][1], validation[-1][1]) if validation else None,
        )

    def rates(self, now: float) -> tuple[float, float]:
        """(calls/s, response tokens/s) over the last RATE_WINDOW_S seconds before ``now``."""
        recent = [(ts, n) for ts, n in self._recent_calls if now - RATE_WINDOW_S <= ts <= now]
        if not recent:
            return 0.0, 0.0
        span = min(RATE_WINDOW_S, max(now - self.first_ts, 1e-9))
        return len(recent) / span, sum(n for _, n in recent) / span

    def staleness(self) -> dict[str, float]:
        """Staleness of the last batch's tokens (from the last step's metrics); empty before one."""
        if not self.state.steps:
            return {}
        metrics = self.state.steps[-1].metrics
        keys = ("staleness_mean", "stale_tokens", "stale_tokens_dropped")
        return {k: float(metrics[k]) for k in keys if k in metrics}

    def phase_totals(self, now: float) -> dict[str, float]:
        """Seconds spent in each phase over the timeline kept."""
        totals: dict[str, float] = {}
        for span in self.timeline:
            totals[span.phase] = totals.get(span.phase, 0.0) + span.duration(now)
        return totals

    def rows(self, where: RolloutFilter | None = None, limit: int | None = None) -> list[RolloutRow]:
        """Rollout rows, newest first, filtered; at most ``limit`` (the newest that match)."""
        out: list[RolloutRow] = []
        for view in reversed(self.state.rollouts.values()):
            row = self.row(view)
            if where is None or where.matches(row):
                out.append(row)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def row(self, view: RolloutView) -> RolloutRow:
        return RolloutRow(
            rollout=view.rollout,
            task_id=view.task_id,
            group=view.group,
            status=state_of(view),
            purpose=view.purpose,
            calls=view.call_count,
            sampled=view.tokens_sampled,
            reward=view.reward,
            version=view.created_version,
            trained_step=view.trained_step,
            duration_s=self._durations.get(view.rollout),
            reason=reason_of(view),
        )

    def tail(self, types: Iterable[str] = (), text: str = "", limit: int = 200) -> list[LogLine]:
        """The last ``limit`` log lines whose type is in ``types`` (all if empty) containing ``text``."""
        wanted = set(types)
        needle = text.lower()
        out: list[LogLine] = []
        for line in reversed(self.log):
            if wanted and line.type not in wanted:
                continue
            if needle and needle not in f"{line.type} {line.rollout} {line.text}".lower():
                continue
            out.append(line)
            if len(out) >= limit:
                break
        out.reverse()
        return out


def describe(event: events.Event) -> str:
    """One line of text for the event log."""
    match event:
        case events.ApplianceStarted():
            what = "started" if event.command == "up" else f"{event.command} started"
            return f"{what} {event.model} on {event.engine} at v{event.resumed_from_version}"
        case events.ApplianceStopped():
            return f"{'stopped' if event.command == 'up' else event.command + ' ended'}: {event.reason}"
        case events.PhaseChanged():
            return f"phase {event.phase} (v{event.policy_version})"
        case events.RolloutCreated():
            return f"{event.purpose} rollout task {event.task_id} group {event.group} v{event.policy_version}"
        case events.LLMCallCompleted():
            return (
                f"call {event.surface} {len(event.prompt_ids)}+{len(event.response_ids)} tok "
                f"{event.finish_reason} v{event.policy_version} {event.total_s * 1000:.0f} ms"
            )
        case events.RewardReported():
            return f"reward {event.reward:+.3f} ({event.source})"
        case events.CallRewardReported():
            return f"call reward {event.reward:+.3f} {event.name} ({event.source})"
        case events.RolloutFinished():
            return event.status + (f": {event.error}" if event.error else "")
        case events.SwitchPhaseCompleted():
            return f"step {event.step} {event.phase} {event.duration_s * 1000:.0f} ms"
        case events.TrainStepCompleted():
            loss = event.metrics.get("loss")
            return (
                f"step {event.step}: {len(event.rollouts)} rollouts, {event.samples} samples, "
                + tokens_text(step_tokens(event))
                + (f", loss {loss:+.4f}" if loss is not None else "")
            )
        case events.PolicyVersionPublished():
            return f"policy v{event.policy_version} at step {event.step}"
        case events.ValidationCompleted():
            return f"validation step {event.step}: reward {event.reward_mean:.3f} ± {event.reward_std:.3f}"
        case events.CheckpointSaved():
            return f"checkpoint {event.path} ({event.reason})"
        case events.ModelExported():
            return f"exported {event.path}"
        case events.ControlRequested():
            return f"control {event.action} by {event.source}"
        case events.AdmissionsPaused():
            return (
                f"admissions paused {event.backoff_s:g} s (trip {event.trips}): {event.failures} "
                f"failed in a row; last: {one_line(event.cause)}"
            )
        case _:
            return event.type
