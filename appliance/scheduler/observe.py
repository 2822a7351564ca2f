"""What ``decide`` sees of the live run: an ``Observation`` read from the log's projection.

Owns :func:`observe` (the groups running, ready and admitted, the validation round, the
breaker's count, the operator's requests, from one ``RunState`` plus the few facts only the
runner knows) and :func:`open_validation`. Pure functions of their arguments, like ``decide``:
the runner (``runner``) calls them on the live state.
"""

from __future__ import annotations

from appliance.scheduler.decide import Observation
from store.projections import RolloutView, RunState, one_line


def _groups(state: RunState) -> dict[str, list[RolloutView]]:
    """Training groups (validation rollouts left out), in admission order."""
    groups: dict[str, list[RolloutView]] = {}
    for view in state.rollouts.values():
        if view.purpose == "train":
            groups.setdefault(view.group, []).append(view)
    return groups


def open_validation(state: RunState) -> list[RolloutView]:
    """The rollouts of the validation round that no ``ValidationCompleted`` records yet."""
    recorded = {rollout for round_ in state.validations for rollout in round_.rollouts}
    return [
        view
        for view in state.rollouts.values()
        if view.purpose == "validation" and view.rollout not in recorded
    ]


def _dead(views: list[RolloutView]) -> bool:
    """A group that can never be trained: every rollout ended and none is trainable."""
    return all(v.status != "running" for v in views) and not any(
        RunState.trainable(v) or v.trained_step is not None for v in views
    )


def observe(
    state: RunState,
    *,
    stopping: bool,
    phase: str = "generate",
    generating_for_s: float = 0.0,
    engine_failed: bool = False,
    admissions_paused: bool = False,
    served_version: int | None = None,
) -> Observation:
    """What ``decide`` sees. A group none of whose rollouts can be trained on (all failed, e.g.
    interrupted by a restart) counts neither as ready nor as admitted: its failures stay
    recorded, and another group takes its place. ``served_version``: the version the engine
    serves when it is not yet the published one (a split step between its events and the end
    of its push), so that no group is admitted against weights that do not sample yet."""
    groups = _groups(state)
    running = [view for view in state.running() if view.purpose == "train"]
    validating = open_validation(state)
    ready = [
        group for group, views in state.ready_groups().items() if any(RunState.trainable(v) for v in views)
    ]
    # Ready groups ahead of the oldest running one, in admission order (dead groups skipped).
    ready_set = set(ready)
    in_order = 0
    for group, views in groups.items():
        if _dead(views) or any(v.trained_step is not None for v in views):
            continue
        if group not in ready_set:
            break
        in_order += 1
    return Observation(
        running_groups=len({view.group for view in running}),
        ready_groups=tuple(ready),
        step=state.step,
        stopping=stopping or state.stop_requested,
        policy_version=state.policy_version if served_version is None else served_version,
        admitted_groups=sum(1 for views in groups.values() if not _dead(views)),
        running_rollouts=len(running),
        phase=phase,
        generating_for_s=generating_for_s,
        engine_failed=engine_failed,
        ready_in_order=in_order,
        paused=state.paused,
        checkpoint_requested=state.checkpoint_requested,
        validation_open=len(validating),
        validation_running=sum(1 for view in validating if view.status == "running"),
        last_validation_step=state.validations[-1].step if state.validations else None,
        consecutive_failures=state.consecutive_failures,
        admissions_paused=admissions_paused,
        breaker_trips=state.breaker_trips,
        last_failure=one_line(state.last_failure),
    )
