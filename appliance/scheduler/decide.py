"""The scheduler's decisions, as a pure function of what it observes.

Owns ``decide(policy, observation) -> actions``: no clock, no I/O, no randomness, so the same
function drives the live runner and the simulator (``appliance.scheduler.simulate``) and can be
table-tested exhaustively.

Three modes share it:

* ``sync``: admit one batch of rollout groups, wait until every admitted rollout has ended, train,
  repeat. Training always sees rollouts sampled entirely by the policy it updates.
* ``async`` (collocated): keep admitting groups while the staleness bound allows, and switch the
  machine to training as soon as the ``batch_groups`` oldest untrained groups are ready, even
  with younger rollouts still running. Their generations are preempted for the switch and
  resume under the new weights (partial rollouts); the harnesses only see a slower call.
  Groups are trained in admission order: a group that finishes early waits for older ones, so
  no group is trained later than the step the staleness bound planned for it.
* ``split`` (placement ``split``: some GPUs generate while the others train): generation never
  stops for training. A step starts as soon as the ``batch_groups`` oldest untrained groups are
  ready and no step is running (the async rule, without ``min_generate_s``: there is no switch
  to amortise), and while it runs the decisions go on: groups are admitted within the same
  staleness bound and in-flight limit as async. The runner pushes the step's weights into the
  serving engine at its end (generation pauses for the push alone; the calls under way continue
  under the new weights, partial rollouts as across an async switch). A step is under way from
  ``Train`` until that push has ended (``Observation.phase == "train"``); meanwhile nothing but
  admissions and the circuit breaker is decided: a stop, a checkpoint, a validation round and a
  failed engine's restart wait for the step. With ``eta = 0`` it is sync without the switches:
  the next batch is admitted only once the step's weights serve.

Operator control and validation are part of the observation too: while ``paused`` no group
is admitted, no step trained and no validation round started (rollouts under way finish, calls
are served); a requested checkpoint is saved at the next decision outside a step; a validation
round (``validation_tasks`` held-out rollouts) starts at step 0 and every ``validate_every``
steps, runs beside the admissions (or alone, with ``validation_holds_admissions``: no group is
admitted until it ends), and holds training back until it ends, so every rollout of a round is
served by one policy version. A round that ended is recorded (``FinishValidation``)
before anything else happens, and a stop waits for a round in flight.

Circuit breaker: after ``breaker_failures`` training rollouts failed in a row (a harness that
always crashes), admissions pause (``PauseAdmissions``; the runner records it and sets the
back-off). While ``admissions_paused`` no group is admitted; steps, validation rounds,
checkpoints and stops go on, so the groups already ready are still trained. After
``breaker_max_trips`` trips in a row (no training rollout finished between them) the breaker
gives up: the trip that would be the last is the stop itself (``Stop`` with ``failure``, not a
``PauseAdmissions``), naming the last failure, once a validation round or a step under way has
ended (nothing is admitted meanwhile). The trips are counted from the process's start
(``RunState`` clears them at ``ApplianceStarted``), so a stopped run resumes.

Staleness bound (``eta``): group number ``g`` (0-based, in admission order) is trained at the
earliest by step ``g // batch_groups + 1``, i.e. with weights of version ``g // batch_groups``.
It may start only while ``g // batch_groups - policy_version <= eta``: a rollout never starts
more than ``eta`` versions before the version it will be trained at. ``eta = 0`` admits only the
next batch (on-policy up to the tokens sampled across a switch).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from appliance.config import ScheduleKnobs

if TYPE_CHECKING:
    from appliance.config import SchedulerConfig

Mode = Literal["sync", "async", "split"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulePolicy(ScheduleKnobs):
    """The ``[scheduler]`` section's knobs (``ScheduleKnobs``, declared once there) as the
    decisions read them. ``from_config`` makes them concrete for a run: ``mode`` "split" with
    split placement, ``eta`` 0 unless async (``eta`` is the staleness bound in policy versions,
    ``max_inflight_rollouts`` the in-flight limit of async and split modes, ``min_generate_s``
    async mode's least generation between switches: split mode has no switch), validation off
    without held-out tasks and ``validation_tasks`` one rollout per held-out task. A policy
    built directly (the simulator, tests) has the section's defaults but for the mode's type
    and the validation rounds and the circuit breaker, off unless it sets them. The knobs only
    the runner reads (deadlines, the breaker's back-off, sleep level, stale tokens) come along
    unread."""

    mode: Mode = "sync"
    #: Off unless set (a run's section turns them on): validation every this many steps, the
    #: breaker's failures in a row and its trips before the run stops.
    validate_every: int = 0
    validation_tasks: int = 1
    breaker_failures: int = 0
    breaker_max_trips: int = 0

    def __post_init__(self) -> None:
        if self.batch_groups < 1 or self.group_size < 1:
            raise ValueError("batch_groups and group_size must be at least 1")
        if self.breaker_failures < 0:
            raise ValueError("breaker_failures must be 0 (off) or more")
        if self.breaker_max_trips < 0:
            raise ValueError("breaker_max_trips must be 0 (never stop) or more")
        if self.max_inflight_rollouts is not None and self.max_inflight_rollouts < self.group_size:
            raise ValueError(
                f"max_inflight_rollouts ({self.max_inflight_rollouts}) must be at least group_size "
                f"({self.group_size}): a group starts all its rollouts at once"
            )

    @classmethod
    def from_config(cls, scheduler: SchedulerConfig, *, placement: str, held_out: int) -> SchedulePolicy:
        """The policy of a run with the ``scheduler`` section, ``placement`` ("collocated" or
        "split") and ``held_out`` validation tasks. Split placement runs split mode (the engine's
        GPUs never stop for a step; with ``mode = "sync"`` the bound is eta 0, so it stays
        on-policy); sync mode has eta 0; no held-out task turns validation off."""
        mode: Mode = "split" if placement == "split" else "async" if scheduler.mode == "async" else "sync"
        knobs = {f.name: getattr(scheduler, f.name) for f in fields(ScheduleKnobs)}
        knobs.update(
            mode=mode,
            eta=scheduler.eta if scheduler.mode == "async" else 0,
            validate_every=scheduler.validate_every if held_out else 0,
            validation_tasks=max(1, held_out),
        )
        return cls(**knobs)

    def inflight_limit(self) -> int:
        if self.max_inflight_rollouts is not None:
            return self.max_inflight_rollouts
        return self.batch_groups * self.group_size * (self.eta + 1)


@dataclass(frozen=True, slots=True)
class Observation:
    #: Groups with at least one rollout still running.
    running_groups: int
    #: Groups whose rollouts have all ended and that no step has consumed, oldest first.
    ready_groups: tuple[str, ...]
    #: The step the run stands at (0 before the first).
    step: int
    #: A stop was requested (signal, operator).
    stopping: bool = False
    #: The policy version now served.
    policy_version: int = 0
    #: Groups admitted so far in this run, all steps included.
    admitted_groups: int = 0
    #: Rollouts running now.
    running_rollouts: int = 0
    #: "generate" (the engine serves) or "train" (a step is under way; in split mode the engine
    #: still serves, until the step's weights are pushed).
    phase: str = "generate"
    #: Seconds since the machine last switched to generating.
    generating_for_s: float = 0.0
    #: The engine failed (e.g. during a switch) and is not serving.
    engine_failed: bool = False
    #: Of ``ready_groups``, how many come before the oldest group still running (in admission
    #: order). Async mode trains groups strictly in admission order, so that a long rollout is
    #: never overtaken by shorter ones admitted after it (which would make its tokens older
    #: than the staleness bound allows).
    ready_in_order: int | None = None
    #: An operator paused the run (``ControlRequested`` "pause" not yet resumed).
    paused: bool = False
    #: An operator asked for a checkpoint that has not been saved yet.
    checkpoint_requested: bool = False
    #: Rollouts of the validation round not yet recorded as completed (0: no round open), and
    #: how many of them still run. Neither count is in ``running_*`` nor ``admitted_groups``.
    validation_open: int = 0
    validation_running: int = 0
    #: The step of the last recorded validation round (None: none yet).
    last_validation_step: int | None = None
    #: Training rollouts failed in a row since the last one that finished or the last trip of
    #: the circuit breaker (rollouts interrupted by a restart or a stop do not count).
    consecutive_failures: int = 0
    #: The circuit breaker's back-off is running: no group may be admitted.
    admissions_paused: bool = False
    #: Trips of the breaker in a row since this process started (no training rollout finished
    #: between them), and the reason of the last failure counted, in one line.
    breaker_trips: int = 0
    last_failure: str = ""


@dataclass(frozen=True, slots=True)
class StartGroups:
    count: int


@dataclass(frozen=True, slots=True)
class Train:
    groups: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RestartEngine:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str
    #: The run cannot go on (the circuit breaker gave up): ``up`` exits non-zero.
    failure: bool = False


@dataclass(frozen=True, slots=True)
class SaveCheckpoint:
    reason: str


@dataclass(frozen=True, slots=True)
class StartValidation:
    tasks: int


@dataclass(frozen=True, slots=True)
class FinishValidation:
    pass


@dataclass(frozen=True, slots=True)
class PauseAdmissions:
    """Trip the circuit breaker: ``failures`` training rollouts failed in a row."""

    failures: int


Action = (
    StartGroups
    | Train
    | RestartEngine
    | Stop
    | SaveCheckpoint
    | StartValidation
    | FinishValidation
    | PauseAdmissions
)


def admissible_groups(policy: SchedulePolicy, obs: Observation) -> int:
    """How many more groups the staleness bound and the in-flight limit allow now."""
    if policy.mode == "sync":
        # One batch at a time: admit the next batch only when the last one is trained.
        return max(0, (obs.step + 1) * policy.batch_groups - obs.admitted_groups)
    by_staleness = (obs.policy_version + policy.eta + 1) * policy.batch_groups - obs.admitted_groups
    by_inflight = (policy.inflight_limit() - obs.running_rollouts) // policy.group_size
    return max(0, min(by_staleness, by_inflight))


def validation_due(policy: SchedulePolicy, obs: Observation) -> bool:
    """A validation round should start now: at step 0 and every ``validate_every`` steps, once."""
    return (
        policy.validate_every > 0
        and obs.step % policy.validate_every == 0
        and obs.last_validation_step != obs.step
        and not obs.validation_open
    )


def breaker_trips(policy: SchedulePolicy, obs: Observation) -> bool:
    """The circuit breaker should trip now: enough failures in a row, and no back-off running."""
    return (
        policy.breaker_failures > 0
        and obs.consecutive_failures >= policy.breaker_failures
        and not obs.admissions_paused
    )


def breaker_gives_up(policy: SchedulePolicy, obs: Observation) -> Stop | None:
    """The stop of a run whose breaker reaches ``breaker_max_trips`` trips in a row (the trips
    recorded, and the one due now: the final trip stops the run instead of pausing it), or None."""
    if policy.breaker_max_trips <= 0:
        return None
    trips = obs.breaker_trips + (1 if breaker_trips(policy, obs) else 0)
    if trips < policy.breaker_max_trips:
        return None
    return Stop(
        f"the circuit breaker tripped {trips} time{'s' if trips > 1 else ''} in a "
        f"row (breaker_max_trips) with no training rollout finished; last failure: "
        f"{obs.last_failure or 'no reason recorded'}",
        failure=True,
    )


def admit_beside_step(policy: SchedulePolicy, obs: Observation) -> list[Action]:
    """Split mode while a step runs on the training GPUs: the generation GPUs keep serving, so
    admissions go on within the bound (and the circuit breaker still trips). Everything else
    waits for the step: a stop, a checkpoint, a validation round, an operator's pause, a
    failed engine's restart."""
    if obs.stopping or obs.paused or obs.engine_failed or obs.validation_open:
        return []
    if breaker_gives_up(policy, obs) is not None:
        return []  # the run stops once the step has ended
    if breaker_trips(policy, obs):
        return [PauseAdmissions(obs.consecutive_failures)]
    more = 0 if obs.admissions_paused else admissible_groups(policy, obs)
    return [StartGroups(more)] if more > 0 else []


def decide(policy: SchedulePolicy, obs: Observation) -> list[Action]:
    """What to do now. An empty list means: wait for the next observation."""
    if obs.phase == "train":
        # A step is under way; it ends on its own (a stop waits for it). In split mode the
        # generation GPUs are not part of it: they keep generating.
        return admit_beside_step(policy, obs) if policy.mode == "split" else []
    if obs.validation_open and not obs.validation_running:
        return [FinishValidation()]
    if obs.checkpoint_requested:
        return [SaveCheckpoint("requested")]
    if obs.stopping:
        # A validation round in flight ends first (its rollouts end or time out on their own).
        return [] if obs.validation_running else [Stop("stop requested")]
    if (gave_up := breaker_gives_up(policy, obs)) is not None:
        return [] if obs.validation_running else [gave_up]
    due = validation_due(policy, obs) and not obs.paused
    if policy.max_steps is not None and obs.step >= policy.max_steps:
        if due:
            return [StartValidation(policy.validation_tasks)]  # the final round
        return [] if obs.validation_running else [Stop(f"reached step {policy.max_steps}")]
    if obs.engine_failed:
        return [RestartEngine()]
    if obs.paused:
        return []
    if breaker_trips(policy, obs):
        return [PauseAdmissions(obs.consecutive_failures)]  # recorded before anything else
    actions: list[Action] = [StartValidation(policy.validation_tasks)] if due else []
    ready = len(obs.ready_groups)
    if ready >= policy.batch_groups and not due and not obs.validation_open:
        if policy.mode == "sync" and obs.running_groups == 0:
            return [Train(obs.ready_groups[: policy.batch_groups])]
        in_order = ready if obs.ready_in_order is None else obs.ready_in_order
        if in_order >= policy.batch_groups and (
            policy.mode == "split"
            or (policy.mode == "async" and obs.generating_for_s >= policy.min_generate_s)
        ):
            return [Train(obs.ready_groups[: policy.batch_groups])]
    held = obs.admissions_paused or (policy.validation_holds_admissions and (due or obs.validation_open))
    more = 0 if held else admissible_groups(policy, obs)
    return [*actions, StartGroups(more)] if more > 0 else actions
