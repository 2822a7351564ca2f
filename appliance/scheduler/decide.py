"""The scheduler's decisions, as a pure function of what it observes.

Owns ``decide(policy, observation) -> actions``: no clock, no I/O, no randomness, so the same
function drives the live runner and a simulator and can be table-tested exhaustively. This is
the synchronous policy: generate a full batch of rollout groups, then train on it with no
rollout in flight, then generate again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulePolicy:
    #: Rollout groups per training step.
    batch_groups: int
    #: Rollouts per group (one task, compared with each other).
    group_size: int
    #: Stop once the run reaches this step (None: run until told to stop).
    max_steps: int | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    #: Groups with at least one rollout still running.
    running_groups: int
    #: Groups whose rollouts have all ended and that no step has consumed, oldest first.
    ready_groups: tuple[str, ...]
    #: The step the run stands at (0 before the first).
    step: int
    #: A stop was requested (signal, ``--steps`` reached elsewhere, an operator).
    stopping: bool = False


@dataclass(frozen=True, slots=True)
class StartGroups:
    count: int


@dataclass(frozen=True, slots=True)
class Train:
    groups: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str


Action = StartGroups | Train | Stop


def decide(policy: SchedulePolicy, obs: Observation) -> list[Action]:
    """What to do now. An empty list means: wait for the next observation."""
    if obs.stopping:
        return [Stop("stop requested")]
    if policy.max_steps is not None and obs.step >= policy.max_steps:
        return [Stop(f"reached step {policy.max_steps}")]
    ready = len(obs.ready_groups)
    if ready >= policy.batch_groups and obs.running_groups == 0:
        return [Train(obs.ready_groups[: policy.batch_groups])]
    missing = policy.batch_groups - ready - obs.running_groups
    if missing > 0:
        return [StartGroups(missing)]
    return []
