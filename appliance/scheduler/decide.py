"""The scheduler's decisions, as a pure function of what it observes.

Owns ``decide(policy, observation) -> actions``: no clock, no I/O, no randomness, so the same
function drives the live runner and the simulator (``appliance.scheduler.simulate``) and can be
table-tested exhaustively.

Two modes share it:

* ``sync``: admit one batch of rollout groups, wait until every admitted rollout has ended, train,
  repeat. Training always sees rollouts sampled entirely by the policy it updates.
* ``async`` (collocated): keep admitting groups while the staleness bound allows, and switch the
  machine to training as soon as the ``batch_groups`` oldest untrained groups are ready, even
  with younger rollouts still running. Their generations are preempted for the switch and
  resume under the new weights (partial rollouts); the harnesses only see a slower call.
  Groups are trained in admission order: a group that finishes early waits for older ones, so
  no group is trained later than the step the staleness bound planned for it.

Staleness bound (``eta``): group number ``g`` (0-based, in admission order) is trained at the
earliest by step ``g // batch_groups + 1``, i.e. with weights of version ``g // batch_groups``.
It may start only while ``g // batch_groups - policy_version <= eta``: a rollout never starts
more than ``eta`` versions before the version it will be trained at. ``eta = 0`` admits only the
next batch (on-policy up to the tokens sampled across a switch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["sync", "async"]


@dataclass(frozen=True, slots=True)
class SchedulePolicy:
    #: Rollout groups per training step.
    batch_groups: int
    #: Rollouts per group (one task, compared with each other).
    group_size: int
    #: Stop once the run reaches this step (None: run until told to stop).
    max_steps: int | None = None
    mode: Mode = "sync"
    #: Staleness bound in policy versions (async mode; sync is always 0).
    eta: int = 1
    #: Most rollouts running at once (async mode); None: ``batch_groups * group_size * (eta + 1)``.
    max_inflight_rollouts: int | None = None
    #: Seconds generation runs at least before a switch to training (async mode), so a switch
    #: never starves the rollouts that were just admitted.
    min_generate_s: float = 0.0

    def __post_init__(self) -> None:
        if self.batch_groups < 1 or self.group_size < 1:
            raise ValueError("batch_groups and group_size must be at least 1")
        if self.max_inflight_rollouts is not None and self.max_inflight_rollouts < self.group_size:
            raise ValueError(
                f"max_inflight_rollouts ({self.max_inflight_rollouts}) must be at least group_size "
                f"({self.group_size}): a group starts all its rollouts at once"
            )

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
    #: "generate" (the engine serves) or "train" (a step is under way).
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


Action = StartGroups | Train | RestartEngine | Stop


def admissible_groups(policy: SchedulePolicy, obs: Observation) -> int:
    """How many more groups the staleness bound and the in-flight limit allow now."""
    if policy.mode == "sync":
        # One batch at a time: admit the next batch only when the last one is trained.
        return max(0, (obs.step + 1) * policy.batch_groups - obs.admitted_groups)
    by_staleness = (obs.policy_version + policy.eta + 1) * policy.batch_groups - obs.admitted_groups
    by_inflight = (policy.inflight_limit() - obs.running_rollouts) // policy.group_size
    return max(0, min(by_staleness, by_inflight))


def decide(policy: SchedulePolicy, obs: Observation) -> list[Action]:
    """What to do now. An empty list means: wait for the next observation."""
    if obs.phase == "train":
        return []  # a step is under way; it ends on its own (a stop waits for it)
    if obs.stopping:
        return [Stop("stop requested")]
    if policy.max_steps is not None and obs.step >= policy.max_steps:
        return [Stop(f"reached step {policy.max_steps}")]
    if obs.engine_failed:
        return [RestartEngine()]
    ready = len(obs.ready_groups)
    if ready >= policy.batch_groups:
        if policy.mode == "sync" and obs.running_groups == 0:
            return [Train(obs.ready_groups[: policy.batch_groups])]
        in_order = ready if obs.ready_in_order is None else obs.ready_in_order
        if (
            policy.mode == "async"
            and in_order >= policy.batch_groups
            and obs.generating_for_s >= policy.min_generate_s
        ):
            return [Train(obs.ready_groups[: policy.batch_groups])]
    more = admissible_groups(policy, obs)
    return [StartGroups(more)] if more > 0 else []
