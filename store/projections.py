"""Projections: the state of a run, folded from its events.

Owns :class:`RunState` and :class:`RolloutView`, and the rules that turn events into them. It does
no I/O and knows nothing of SQLite: callers read events (``EventStore.read``/``subscribe``) and
feed them to :meth:`RunState.apply`.

A rollout's calls are kept only until something consumes it (a training step, a validation round,
an evaluation): then the view keeps their count and sampled tokens and drops the calls, which the
log still holds, so the state of a long run grows with its rollouts, not with every prompt of
every call.

Invariant: the state is a pure function of the event sequence. Folding the same events gives the
same state, whether all at once after a restart or one by one as they commit. Events about a
rollout that was never created are ignored rather than raised on, so a fold never fails.

The circuit breaker's state is folded here too: training rollouts failed in a row (a failure
that only says the appliance went away, "interrupted" by a restart or "cancelled" by a stop,
is not the harness's and does not count), and the last ``AdmissionsPaused``. Whether its
back-off is still running depends on the clock, so callers ask with a time
(:meth:`RunState.admissions_paused_at`); the fold itself reads none. A start
(``ApplianceStarted``) clears the trips in a row and the back-off: a run the breaker stopped
(``breaker_max_trips``) resumes as a fresh try.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from store.codec import StoredEvent
from store.events import (
    AdmissionsPaused,
    ApplianceStarted,
    ApplianceStopped,
    CallRewardReported,
    CheckpointSaved,
    ControlRequested,
    EngineCaughtUp,
    EngineLost,
    EngineRegistered,
    EvaluationCompleted,
    Event,
    JsonObject,
    LLMCallCompleted,
    LLMCallRefused,
    PhaseChanged,
    PolicyVersionPublished,
    RewardReported,
    RolloutClaimed,
    RolloutCreated,
    RolloutFinished,
    TrainStepCompleted,
    ValidationCompleted,
)

STATUSES = ("running", "finished", "failed")
#: How the errors of rollouts that failed because the appliance stopped begin (recorded by the
#: app's recovery and the controller), or that were withdrawn before any runner claimed them (to
#: start a runner's own task first): not a failure of the harness.
NOT_THE_HARNESS = ("interrupted:", "cancelled: the appliance stopped", "AgentFailed: withdrawn:")


def one_line(error: str, limit: int = 300) -> str:
    """A multi-line failure reason as one line: its first line, then the end of the rest (e.g.
    ``AgentFailed: agent exit code 1: ... ValueError: boom``), at most about ``limit`` chars."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    head, rest = lines[0], " | ".join(lines[1:])
    if len(head) > limit:
        head = head[: limit - 3] + "..."
    room = max(limit - len(head) - 2, 40)
    if len(rest) > room:
        rest = "..." + rest[-(room - 3) :]
    if not rest:
        return head
    return f"{head} {rest}" if head.endswith(":") else f"{head}: {rest}"


def reward_mean(views: Iterable[RolloutView]) -> float | None:
    """The mean reward of ``views`` that finished cleanly with a reward (:meth:`RunState.trainable`),
    whether or not they called the model; None when none did.

    The one rule behind every reward a training step shows: the recorded ``reward_mean`` metric,
    the progress line of ``up`` and ``status``. Failed rollouts do not count (``rollouts_failed``
    counts them), nor, since the controller fails them, rollouts whose calls were all refused or
    that made no model call; one that finished without a call in an older log still counts.
    """
    rewards = [float(v.reward) for v in views if RunState.trainable(v) and v.reward is not None]
    return fmean(rewards) if rewards else None


@dataclass
class RolloutView:
    """One rollout as the scheduler, trainer and dashboard see it."""

    rollout: str
    task_id: str
    group: str
    task: JsonObject
    adapter: str
    #: The policy version being served when the rollout was created.
    created_version: int
    status: str = "running"
    #: The calls recorded, in order, until the rollout is consumed (see ``released``).
    calls: list[LLMCallCompleted] = field(default_factory=list)
    #: Calls recorded, the tokens the policy sampled for them and their prompts' tokens (each
    #: call's whole prompt), kept after the calls are released.
    call_count: int = 0
    tokens_sampled: int = 0
    tokens_prompt: int = 0
    #: Seconds from its start to its end (``RolloutFinished``); None while it runs.
    duration_s: float | None = None
    #: True once a training step, a validation round or an evaluation consumed the rollout: its
    #: ``calls`` are then dropped from the state (a long run would otherwise hold every prompt of
    #: every call for the life of the process); the log still has them
    #: (``EventStore.read(rollout=...)``, ``store.eventstore.read_calls_sync``).
    released: bool = False
    #: The last reward reported, or None if none was.
    reward: float | None = None
    error: str = ""
    #: The training step that consumed this rollout, or None while it is untrained.
    trained_step: int | None = None
    #: "train" or "validation" (validation rollouts are never trained on).
    purpose: str = "train"
    #: Intermediate rewards reported on single calls, in order.
    call_rewards: list[CallRewardReported] = field(default_factory=list)
    #: Model calls the proxy refused (``LLMCallRefused``), and the last one's reason in one line.
    refused_calls: int = 0
    last_refusal: str = ""
    #: An external runner claimed it (``RolloutClaimed``); False for the appliance's own agents.
    claimed: bool = False


@dataclass
class ReplicaView:
    """A remote engine replica as the log knows it (``EngineRegistered`` and what followed)."""

    replica: str
    url: str
    model: str
    #: The policy version it serves as far as the log knows (-1: not known yet).
    policy_version: int
    #: "registered" (it joined and takes the run's version), "caught up" or "lost".
    state: str = "registered"
    #: Why it was lost, in one line ("" unless lost).
    reason: str = ""
    #: How it takes new weights (``EngineRegistered.weights``).
    weights: str = ""


@dataclass
class RunState:
    """The whole run: policy version, training progress and every rollout, in creation order."""

    run_id: str = ""
    policy_version: int = 0
    step: int = 0
    checkpoint: str = ""
    phase: str = "idle"
    #: How many times the appliance started on this store (1 + restarts).
    starts: int = 0
    #: The latest start of the run (``up``: its settings and trainer ranks), if any; an
    #: evaluation's start (``command`` "eval") is not the run's and leaves it.
    last_start: ApplianceStarted | None = None
    #: How the run's latest start ended: its ``ApplianceStopped`` (the reason, whether it
    #: failed), or None while it runs or when it ended without one (a crash). An evaluation's
    #: stop is not the run's and leaves it.
    last_stop: ApplianceStopped | None = None
    #: Position of the last event applied (0 when positions are not known).
    position: int = 0
    rollouts: dict[str, RolloutView] = field(default_factory=dict)
    steps: list[TrainStepCompleted] = field(default_factory=list)
    validations: list[ValidationCompleted] = field(default_factory=list)
    evaluations: list[EvaluationCompleted] = field(default_factory=list)
    #: True between an operator's "pause" and "resume".
    paused: bool = False
    #: The last full checkpoint saved (relative path), if any.
    last_checkpoint: CheckpointSaved | None = None
    #: An operator asked for a checkpoint that no ``CheckpointSaved`` "requested" answered yet.
    checkpoint_requested: bool = False
    #: An operator asked this process to stop (a later ``ApplianceStarted`` clears it).
    stop_requested: bool = False
    #: Training rollouts failed in a row (a finished one, or a trip of the breaker, resets it).
    consecutive_failures: int = 0
    #: The error of the last training rollout counted in ``consecutive_failures``.
    last_failure: str = ""
    #: The circuit breaker's last trip, if any (its back-off may be over: see
    #: :meth:`admissions_paused_at`).
    admissions_paused: AdmissionsPaused | None = None
    #: Trips in a row: trips that no finished training rollout separates (0 after one finished,
    #: and at each start: a run the breaker stopped resumes with its full count of trips).
    breaker_trips: int = 0
    #: Remote engine replicas registered and not removed, by id, in registration order (a
    #: start re-attaches them).
    replicas: dict[str, ReplicaView] = field(default_factory=dict)

    @classmethod
    def from_events(cls, events: Iterable[Event | StoredEvent]) -> RunState:
        """Fold ``events`` (bare, or with their positions) into a fresh state."""
        state = cls()
        for item in events:
            if isinstance(item, StoredEvent):
                state.apply(item.event, item.position)
            else:
                state.apply(item)
        return state

    def apply(self, event: Event, position: int = 0) -> None:
        """Fold one event into the state."""
        self.position = max(self.position, position)
        match event:
            case ApplianceStarted():
                self.run_id = event.run_id
                self.starts += 1
                if event.command == "up":
                    self.last_start, self.last_stop = event, None
                self.stop_requested = False
                # A start is a fresh try: the back-off and the trips in a row of the last process
                # (which may have stopped on ``breaker_max_trips``) do not hold it back.
                self.breaker_trips = 0
                self.admissions_paused = None
            case PhaseChanged():
                self.phase = event.phase
            case PolicyVersionPublished():
                self.policy_version = event.policy_version
                self.checkpoint = event.checkpoint
            case RolloutCreated():
                self.rollouts[event.rollout] = RolloutView(
                    rollout=event.rollout,
                    task_id=event.task_id,
                    group=event.group,
                    task=event.task,
                    adapter=event.adapter,
                    created_version=event.policy_version,
                    purpose=event.purpose,
                )
            case LLMCallCompleted():
                if view := self.rollouts.get(event.rollout):
                    view.call_count += 1
                    view.tokens_sampled += len(event.response_ids)
                    view.tokens_prompt += len(event.prompt_ids)
                    if not view.released:
                        view.calls.append(event)
            case LLMCallRefused():
                if view := self.rollouts.get(event.rollout):
                    view.refused_calls += 1
                    view.last_refusal = event.reason()
            case RewardReported():
                if view := self.rollouts.get(event.rollout):
                    view.reward = event.reward
            case CallRewardReported():
                if view := self.rollouts.get(event.rollout):
                    view.call_rewards.append(event)
            case RolloutClaimed():
                if view := self.rollouts.get(event.rollout):
                    view.claimed = True
            case ValidationCompleted():
                self.validations.append(event)
                self._release(event.rollouts)
            case EvaluationCompleted():
                self.evaluations.append(event)
                self._release(event.rollouts)
            case CheckpointSaved():
                self.last_checkpoint = event
                if event.reason == "requested":
                    self.checkpoint_requested = False
            case ControlRequested():
                if event.action in ("pause", "resume"):
                    self.paused = event.action == "pause"
                elif event.action == "checkpoint":
                    self.checkpoint_requested = True
                elif event.action == "stop":
                    self.stop_requested = True
            case RolloutFinished():
                if view := self.rollouts.get(event.rollout):
                    view.status = event.status
                    view.error = event.error
                    view.duration_s = event.duration_s
                    if view.purpose == "train":
                        self._count_for_breaker(event)
            case AdmissionsPaused():
                self.admissions_paused = event
                self.breaker_trips = event.trips
                self.consecutive_failures = 0  # the next trip needs as many failures again
            case TrainStepCompleted():
                self.step = event.step
                self.steps.append(event)
                for rollout in event.rollouts:
                    if view := self.rollouts.get(rollout):
                        view.trained_step = event.step
                self._release(event.rollouts)
            case ApplianceStopped():
                if event.command == "up":
                    self.last_stop = event
            case EngineRegistered():
                self.replicas.pop(event.replica, None)  # registered again: now the newest
                self.replicas[event.replica] = ReplicaView(
                    event.replica, event.url, event.model, event.policy_version, weights=event.weights
                )
            case EngineCaughtUp():
                if replica := self.replicas.get(event.replica):
                    replica.policy_version, replica.state = event.policy_version, "caught up"
                    replica.reason = ""
            case EngineLost():
                if event.removed:
                    self.replicas.pop(event.replica, None)
                elif replica := self.replicas.get(event.replica):
                    replica.state, replica.reason = "lost", one_line(event.reason)
            case _:
                pass  # types this fold does not track

    def _release(self, rollouts: Iterable[str]) -> None:
        """Drop the calls of consumed rollouts (their counts stay; the log keeps the calls)."""
        for rollout in rollouts:
            if view := self.rollouts.get(rollout):
                view.calls = []
                view.released = True

    def _count_for_breaker(self, event: RolloutFinished) -> None:
        if event.status == "finished":
            self.consecutive_failures = 0
            self.breaker_trips = 0
        elif not event.error.startswith(NOT_THE_HARNESS):
            self.consecutive_failures += 1
            self.last_failure = event.error

    def admissions_paused_at(self, now: float) -> AdmissionsPaused | None:
        """The breaker's trip whose back-off runs at ``now`` (seconds since the epoch), or None."""
        trip = self.admissions_paused
        if trip is not None and now < trip.ts + trip.backoff_s:
            return trip
        return None

    def running(self) -> list[RolloutView]:
        """Rollouts whose harness has not ended, in creation order."""
        return [view for view in self.rollouts.values() if view.status == "running"]

    def ready_groups(self) -> dict[str, list[RolloutView]]:
        """Groups whose rollouts have all ended and none was trained on, by first creation.

        A ready group may hold failed or unrewarded rollouts: filter them with :meth:`trainable`.
        """
        groups: dict[str, list[RolloutView]] = {}
        for view in self.rollouts.values():
            if view.purpose == "train":
                groups.setdefault(view.group, []).append(view)
        return {
            name: views
            for name, views in groups.items()
            if all(v.status != "running" and v.trained_step is None for v in views)
        }

    @staticmethod
    def trainable(view: RolloutView) -> bool:
        """A rollout can be trained on once it finished cleanly and has a reward."""
        return view.status == "finished" and view.reward is not None

    def step_reward(self, step: TrainStepCompleted) -> float | None:
        """The mean reward of the rollouts ``step`` consumed, by :func:`reward_mean`'s rule."""
        return reward_mean(self.rollouts[r] for r in step.rollouts if r in self.rollouts)

    def summary(self) -> dict[str, Any]:
        """Headline numbers for the CLI ``status`` command and the dashboard."""
        counts = dict.fromkeys(STATUSES, 0)
        for view in self.rollouts.values():
            counts[view.status] = counts.get(view.status, 0) + 1
        return {
            "run_id": self.run_id,
            "phase": self.phase,
            "policy_version": self.policy_version,
            "step": self.step,
            "steps": len(self.steps),
            "rollouts": counts,
            "mean_reward": self.step_reward(self.steps[-1]) if self.steps else None,
            "validation_reward": self.validations[-1].reward_mean if self.validations else None,
            "paused": self.paused,
            "calls": sum(view.call_count for view in self.rollouts.values()),
            "tokens_sampled": sum(view.tokens_sampled for view in self.rollouts.values()),
            "tokens_prompt": sum(view.tokens_prompt for view in self.rollouts.values()),
            "tokens_trained": sum(int(s.metrics.get("tokens_trained", 0)) for s in self.steps),
        }
