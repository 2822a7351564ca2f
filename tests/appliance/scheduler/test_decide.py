"""Table tests of the scheduler's pure decisions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from appliance.scheduler.decide import (
    Action,
    FinishValidation,
    Observation,
    PauseAdmissions,
    RestartEngine,
    SaveCheckpoint,
    SchedulePolicy,
    StartGroups,
    StartValidation,
    Stop,
    Train,
    admissible_groups,
    decide,
)

SYNC = SchedulePolicy(batch_groups=2, group_size=4, max_steps=3, mode="sync")
ASYNC = SchedulePolicy(batch_groups=2, group_size=4, max_steps=10, mode="async", eta=1)
SPLIT = SchedulePolicy(batch_groups=2, group_size=4, max_steps=10, mode="split", eta=1)


def obs(**fields: object) -> Observation:
    base: dict[str, object] = {"running_groups": 0, "ready_groups": (), "step": 0}
    base.update(fields)
    return Observation(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "observation", "expected"),
    [
        # --- sync -------------------------------------------------------------------------
        # Nothing admitted: start a whole batch.
        (SYNC, obs(), [StartGroups(2)]),
        # One group running: top up to the batch.
        (SYNC, obs(running_groups=1, admitted_groups=1, running_rollouts=4), [StartGroups(1)]),
        # The batch is admitted, one group still running: wait.
        (SYNC, obs(running_groups=1, ready_groups=("g0",), admitted_groups=2), []),
        # Batch ready but a straggler runs: sync waits for it.
        (SYNC, obs(running_groups=1, ready_groups=("g0", "g1"), admitted_groups=3), []),
        # Batch ready, nothing in flight: train the oldest groups.
        (SYNC, obs(ready_groups=("g0", "g1", "g2"), admitted_groups=3, step=1), [Train(("g0", "g1"))]),
        # Step target reached: stop even with work ready.
        (SYNC, obs(ready_groups=("g0", "g1"), step=3), [Stop("reached step 3")]),
        # --- async: batch ready while calls are in flight -> switch anyway ---------------------
        (ASYNC, obs(running_groups=2, ready_groups=("g0", "g1"), admitted_groups=4, running_rollouts=8),
         [Train(("g0", "g1"))]),
        # Staleness gate closed: version 0, eta 1, four groups admitted (two batches ahead).
        (ASYNC, obs(running_groups=3, ready_groups=("g0",), admitted_groups=4, running_rollouts=12), []),
        # ... and open again one version later.
        (ASYNC, obs(running_groups=2, admitted_groups=4, policy_version=1, step=1, running_rollouts=8),
         [StartGroups(2)]),
        # In-flight limit: the bound would allow more, but 16 rollouts already run.
        (SchedulePolicy(batch_groups=2, group_size=4, mode="async", eta=3, max_inflight_rollouts=16),
         obs(running_groups=4, admitted_groups=4, running_rollouts=16), []),
        # A younger group finished first, the oldest still runs: async keeps admission order.
        (ASYNC, obs(running_groups=1, ready_groups=("g1", "g2"), admitted_groups=3, running_rollouts=4,
                    ready_in_order=0), [StartGroups(1)]),
        # Minimum generation slice not reached: no switch yet, keep admitting what is allowed.
        (SchedulePolicy(batch_groups=1, group_size=2, mode="async", min_generate_s=5.0),
         obs(running_groups=1, ready_groups=("g0",), admitted_groups=2, running_rollouts=2,
             generating_for_s=1.0),
         []),
        # --- failures and shutdown -----------------------------------------------------------
        # The engine failed during a switch: restart it before anything else.
        (ASYNC, obs(ready_groups=("g0", "g1"), admitted_groups=2, engine_failed=True), [RestartEngine()]),
        # Shutdown requested during training: let the step finish (no action) ...
        (ASYNC, obs(phase="train", stopping=True, admitted_groups=2), []),
        # ... then stop.
        (ASYNC, obs(stopping=True, admitted_groups=2, step=1), [Stop("stop requested")]),
        # A stop wins over an engine failure: nothing is restarted on the way out.
        (SYNC, obs(stopping=True, engine_failed=True), [Stop("stop requested")]),
    ],
)  # fmt: skip
def test_decide_table(policy: SchedulePolicy, observation: Observation, expected: list[Action]) -> None:
    assert decide(policy, observation) == expected


@pytest.mark.parametrize(
    ("policy", "observation", "expected"),
    [
        # --- split: the step does not stop generation ------------------------------------------
        # Nothing admitted: the bound allows two batches ahead (eta 1), as async.
        (SPLIT, obs(), [StartGroups(4)]),
        # The two oldest groups are ready, younger ones still run: train them now, as async.
        (SPLIT, obs(running_groups=2, ready_groups=("g0", "g1"), admitted_groups=4, running_rollouts=8,
                    ready_in_order=2), [Train(("g0", "g1"))]),
        # A younger group finished first, the oldest still runs: admission order holds.
        (SPLIT, obs(running_groups=1, ready_groups=("g1", "g2"), admitted_groups=3, running_rollouts=4,
                    ready_in_order=0), [StartGroups(1)]),
        # min_generate_s is for switches; split has none: it trains at once.
        (SchedulePolicy(batch_groups=1, group_size=2, mode="split", min_generate_s=5.0),
         obs(running_groups=1, ready_groups=("g0",), admitted_groups=2, running_rollouts=2,
             generating_for_s=1.0),
         [Train(("g0",))]),
        # A step under way (collocated async: nothing until it ends) ...
        (ASYNC, obs(phase="train", running_groups=1, admitted_groups=3, running_rollouts=4), []),
        # ... split keeps admitting beside it, within the staleness bound ...
        (SPLIT, obs(phase="train", running_groups=1, admitted_groups=3, running_rollouts=4),
         [StartGroups(1)]),
        # ... and the in-flight limit.
        (SchedulePolicy(batch_groups=2, group_size=4, mode="split", eta=3, max_inflight_rollouts=8),
         obs(phase="train", running_groups=1, admitted_groups=3, running_rollouts=4), [StartGroups(1)]),
        # The bound is reached during the step: wait (the push opens it).
        (SPLIT, obs(phase="train", running_groups=2, admitted_groups=4, running_rollouts=8), []),
        # ... and one version later it is open again.
        (SPLIT, obs(phase="train", running_groups=2, admitted_groups=4, running_rollouts=8, policy_version=1,
                    step=1), [StartGroups(2)]),
        # Never a second step beside the first, whatever is ready.
        (SPLIT, obs(phase="train", ready_groups=("g2", "g3"), admitted_groups=4, ready_in_order=2), []),
        # eta 0: sync without the switches: nothing beside the step, the next batch after the push.
        (SchedulePolicy(batch_groups=2, group_size=4, mode="split", eta=0),
         obs(phase="train", admitted_groups=2), []),
        (SchedulePolicy(batch_groups=2, group_size=4, mode="split", eta=0),
         obs(admitted_groups=2, policy_version=1, step=1), [StartGroups(2)]),
        # A stop, a pause, a checkpoint and a failed engine wait for the step, as does the trip's
        # back-off; the breaker itself still trips beside it.
        (SPLIT, obs(phase="train", stopping=True, admitted_groups=2), []),
        (SPLIT, obs(phase="train", paused=True, admitted_groups=2), []),
        (SPLIT, obs(phase="train", checkpoint_requested=True, admitted_groups=4), []),
        (SPLIT, obs(phase="train", engine_failed=True, admitted_groups=2), []),
        (SPLIT, obs(phase="train", admissions_paused=True, admitted_groups=2), []),
        (SchedulePolicy(batch_groups=2, group_size=4, mode="split", breaker_failures=8),
         obs(phase="train", consecutive_failures=8, admitted_groups=2), [PauseAdmissions(8)]),
        # After the step: the stop and the checkpoint it held back.
        (SPLIT, obs(stopping=True, admitted_groups=4, step=1, policy_version=1), [Stop("stop requested")]),
        (SPLIT, obs(checkpoint_requested=True, admitted_groups=4, step=1), [SaveCheckpoint("requested")]),
        # The step target reached: stop.
        (SPLIT, obs(ready_groups=("g0", "g1"), admitted_groups=22, step=10, ready_in_order=2),
         [Stop("reached step 10")]),
    ],
)  # fmt: skip
def test_decide_split(policy: SchedulePolicy, observation: Observation, expected: list[Action]) -> None:
    assert decide(policy, observation) == expected


def test_split_admits_like_async_and_never_trains_beside_a_step() -> None:
    """Split's admissions are async's (same bound, same limit), in both phases; and whatever the
    observation during a step, no second step, stop, checkpoint or validation round starts."""
    for phase in ("generate", "train"):
        for version in range(3):
            for admitted in range(0, 10):
                for running in (0, 4, 8, 12):
                    observation = obs(phase=phase, policy_version=version, step=version,
                                      admitted_groups=admitted, running_rollouts=running,
                                      running_groups=running // 4)  # fmt: skip
                    assert admissible_groups(SPLIT, observation) == admissible_groups(ASYNC, observation)
    validating = SchedulePolicy(batch_groups=2, group_size=4, mode="split", validate_every=1)
    for policy in (SPLIT, validating):
        for ready in ((), ("g0", "g1"), ("g0", "g1", "g2", "g3")):
            for flags in ({}, {"stopping": True}, {"checkpoint_requested": True}, {"engine_failed": True}):
                observation = obs(phase="train", ready_groups=ready, admitted_groups=len(ready),
                                  ready_in_order=len(ready), **flags)  # fmt: skip
                actions = decide(policy, observation)
                assert all(isinstance(a, StartGroups) for a in actions), (observation, actions)


def test_no_step_limit_never_stops_by_itself() -> None:
    policy = SchedulePolicy(batch_groups=1, group_size=2, max_steps=None)
    assert decide(policy, obs(ready_groups=("g",), admitted_groups=1, step=10_000)) == [Train(("g",))]


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_admission_never_runs_more_than_eta_versions_ahead(eta: int) -> None:
    """Admit greedily for several versions: group g starts at a version v with g//B - v <= eta."""
    policy = SchedulePolicy(batch_groups=2, group_size=1, mode="async", eta=eta, max_inflight_rollouts=1000)
    admitted = 0
    for version in range(5):
        more = admissible_groups(policy, obs(policy_version=version, admitted_groups=admitted, step=version))
        for g in range(admitted, admitted + more):
            assert g // policy.batch_groups - version <= eta
        admitted += more
        # The bound is tight: one more group would break it.
        assert (admitted // policy.batch_groups) - version == eta + 1


def test_in_flight_limit_below_a_group_is_refused() -> None:
    with pytest.raises(ValueError, match="at least group_size"):
        SchedulePolicy(batch_groups=2, group_size=4, mode="async", max_inflight_rollouts=3)


VALIDATING = SchedulePolicy(batch_groups=2, group_size=4, max_steps=4, mode="sync", validate_every=2,
                            validation_tasks=3)  # fmt: skip
VALIDATING_ASYNC = SchedulePolicy(batch_groups=2, group_size=4, max_steps=4, mode="async", eta=1,
                                  validate_every=2, validation_tasks=3)  # fmt: skip
ALONE_ASYNC = SchedulePolicy(batch_groups=2, group_size=4, max_steps=4, mode="async", eta=1,
                             validate_every=2, validation_tasks=3,
                             validation_holds_admissions=True)  # fmt: skip
ALONE_SYNC = SchedulePolicy(batch_groups=2, group_size=4, max_steps=4, mode="sync", validate_every=2,
                            validation_tasks=3, validation_holds_admissions=True)  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "observation", "expected"),
    [
        # --- operator pause ----------------------------------------------------------------------
        # Paused: nothing is admitted, even with nothing running ...
        (SYNC, obs(paused=True), []),
        # ... and no step is trained, even with a whole batch ready.
        (SYNC, obs(paused=True, ready_groups=("g0", "g1"), admitted_groups=2), []),
        (ASYNC, obs(paused=True, running_groups=2, ready_groups=("g0", "g1"), admitted_groups=4,
                    running_rollouts=8), []),
        # A step under way when the pause arrives finishes on its own.
        (SYNC, obs(paused=True, phase="train"), []),
        # Paused, a stop still stops, and a failed engine is still restarted (calls are served).
        (SYNC, obs(paused=True, stopping=True), [Stop("stop requested")]),
        (SYNC, obs(paused=True, engine_failed=True), [RestartEngine()]),
        # Resumed (not paused): back to admitting.
        (SYNC, obs(paused=False), [StartGroups(2)]),
        # --- requested checkpoint ----------------------------------------------------------------
        # Saved at the next decision outside a step, before anything else, also while paused.
        (SYNC, obs(checkpoint_requested=True, ready_groups=("g0", "g1"), admitted_groups=2),
         [SaveCheckpoint("requested")]),
        (SYNC, obs(checkpoint_requested=True, paused=True), [SaveCheckpoint("requested")]),
        (SYNC, obs(checkpoint_requested=True, stopping=True), [SaveCheckpoint("requested")]),
        # Never inside a step.
        (ASYNC, obs(checkpoint_requested=True, phase="train"), []),
        # --- validation rounds -------------------------------------------------------------------
        # Off by default: no round at step 0.
        (SYNC, obs(), [StartGroups(2)]),
        # Baseline round at step 0, beside the first batch's admissions.
        (VALIDATING, obs(), [StartValidation(3), StartGroups(2)]),
        # The round runs: the batch is ready but training waits for the round (sync) ...
        (VALIDATING, obs(ready_groups=("g0", "g1"), admitted_groups=2, validation_open=3,
                         validation_running=1, last_validation_step=None), []),
        # ... and in async mode too, while admissions continue within the bound.
        (VALIDATING_ASYNC, obs(ready_groups=("g0", "g1"), admitted_groups=2, validation_open=3,
                               validation_running=2), [StartGroups(2)]),
        # A round that runs alone: it starts without the groups beside it (sync and async) ...
        (ALONE_SYNC, obs(), [StartValidation(3)]),
        (ALONE_ASYNC, obs(), [StartValidation(3)]),
        (ALONE_ASYNC, obs(step=2, admitted_groups=5, policy_version=2, last_validation_step=0),
         [StartValidation(3)]),
        # ... none is admitted while it runs (the rollouts under way go on) ...
        (ALONE_ASYNC, obs(running_groups=1, admitted_groups=1, validation_open=3, validation_running=2,
                          running_rollouts=4), []),
        # ... nor once its rollouts ended and it is not yet recorded ...
        (ALONE_SYNC, obs(validation_open=3, validation_running=0), [FinishValidation()]),
        # ... and once recorded, admissions go on within the bounds.
        (ALONE_ASYNC, obs(last_validation_step=0), [StartGroups(4)]),
        (ALONE_SYNC, obs(last_validation_step=0), [StartGroups(2)]),
        # Every rollout of the round ended: record it first.
        (VALIDATING, obs(ready_groups=("g0", "g1"), admitted_groups=2, validation_open=3,
                         validation_running=0), [FinishValidation()]),
        # Recorded at step 0: train the ready batch.
        (VALIDATING, obs(ready_groups=("g0", "g1"), admitted_groups=2, last_validation_step=0),
         [Train(("g0", "g1"))]),
        # Step 1 is not a validation step.
        (VALIDATING, obs(step=1, admitted_groups=2, last_validation_step=0), [StartGroups(2)]),
        # Step 2 is: a new round with the next batch.
        (VALIDATING, obs(step=2, admitted_groups=4, last_validation_step=0),
         [StartValidation(3), StartGroups(2)]),
        # Paused: no new round.
        (VALIDATING, obs(step=2, admitted_groups=4, last_validation_step=0, paused=True), []),
        # The step target reached at a validation step: a final round, then stop once recorded.
        (VALIDATING, obs(step=4, admitted_groups=8, last_validation_step=2), [StartValidation(3)]),
        (VALIDATING, obs(step=4, admitted_groups=8, validation_open=3, validation_running=3,
                         last_validation_step=2), []),
        (VALIDATING, obs(step=4, admitted_groups=8, last_validation_step=4), [Stop("reached step 4")]),
        # A stop waits for the round in flight, then records it, then stops.
        (VALIDATING, obs(stopping=True, validation_open=3, validation_running=1), []),
        (VALIDATING, obs(stopping=True, validation_open=3, validation_running=0), [FinishValidation()]),
        (VALIDATING, obs(stopping=True, last_validation_step=0), [Stop("stop requested")]),
    ],
)  # fmt: skip
def test_decide_control_and_validation(
    policy: SchedulePolicy, observation: Observation, expected: list[Action]
) -> None:
    assert decide(policy, observation) == expected


def test_validation_never_runs_beside_a_step() -> None:
    """Whatever the observation outside a step: a Train is never decided while a round is open
    or due, so every rollout of a round is served by one policy version."""
    for step in range(5):
        for open_, running in ((0, 0), (3, 0), (3, 2)):
            for last in (None, step, step - 1):
                observation = obs(step=step, ready_groups=("a", "b"), admitted_groups=2 * (step + 1),
                                  validation_open=open_, validation_running=running,
                                  last_validation_step=last)  # fmt: skip
                actions = decide(VALIDATING, observation)
                starts_round = any(isinstance(a, StartValidation) for a in actions)
                if open_ or starts_round:
                    assert not any(isinstance(a, Train) for a in actions), (observation, actions)


BREAKER = SchedulePolicy(batch_groups=2, group_size=4, max_steps=3, mode="sync", breaker_failures=8)
BREAKER_ASYNC = SchedulePolicy(batch_groups=2, group_size=4, max_steps=10, mode="async", eta=1,
                               breaker_failures=8)  # fmt: skip
VALIDATING_BREAKER = SchedulePolicy(batch_groups=2, group_size=4, max_steps=4, mode="sync", validate_every=2,
                                    validation_tasks=3, breaker_failures=8)  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "observation", "expected"),
    [
        # Off by default: any number of failures in a row admits replacements.
        (SYNC, obs(consecutive_failures=1000), [StartGroups(2)]),
        # One short of the threshold: still admitting.
        (BREAKER, obs(consecutive_failures=7), [StartGroups(2)]),
        # At the threshold: trip, and nothing else in that decision.
        (BREAKER, obs(consecutive_failures=8), [PauseAdmissions(8)]),
        (BREAKER_ASYNC, obs(consecutive_failures=9, running_groups=1, admitted_groups=1, running_rollouts=4),
         [PauseAdmissions(9)]),
        # The back-off runs: no admissions, even with room for a whole batch ...
        (BREAKER, obs(admissions_paused=True), []),
        (BREAKER_ASYNC, obs(admissions_paused=True, running_groups=1, admitted_groups=1, running_rollouts=4),
         []),
        # ... and failures that end during it do not trip it again before it is over.
        (BREAKER, obs(admissions_paused=True, consecutive_failures=12), []),
        # Over, with enough failures in a row meanwhile: trip again (the runner doubles the back-off).
        (BREAKER, obs(admissions_paused=False, consecutive_failures=8), [PauseAdmissions(8)]),
        # Steps go on while paused (sync: a ready batch, nothing running) ...
        (BREAKER, obs(admissions_paused=True, ready_groups=("g0", "g1"), admitted_groups=2),
         [Train(("g0", "g1"))]),
        # ... in async mode too, with younger groups still running.
        (BREAKER_ASYNC, obs(admissions_paused=True, running_groups=1, ready_groups=("g0", "g1"),
                            admitted_groups=3, running_rollouts=4), [Train(("g0", "g1"))]),
        # ... and validation rounds start, without the groups that would come beside them.
        (VALIDATING_BREAKER, obs(admissions_paused=True), [StartValidation(3)]),
        (VALIDATING_BREAKER, obs(admissions_paused=True, validation_open=3, validation_running=0),
         [FinishValidation()]),
        # A requested checkpoint is saved and a stop stops, whether tripping or paused.
        (BREAKER, obs(consecutive_failures=8, checkpoint_requested=True), [SaveCheckpoint("requested")]),
        (BREAKER, obs(admissions_paused=True, checkpoint_requested=True), [SaveCheckpoint("requested")]),
        (BREAKER, obs(consecutive_failures=8, stopping=True), [Stop("stop requested")]),
        (BREAKER, obs(admissions_paused=True, stopping=True), [Stop("stop requested")]),
        # The step target reached: stop, no trip.
        (BREAKER, obs(consecutive_failures=8, step=3), [Stop("reached step 3")]),
        # A failed engine is restarted first; an operator's pause holds the trip back.
        (BREAKER, obs(consecutive_failures=8, engine_failed=True), [RestartEngine()]),
        (BREAKER, obs(consecutive_failures=8, paused=True), []),
        # A step under way: nothing is decided until it ends.
        (BREAKER, obs(consecutive_failures=8, phase="train"), []),
    ],
)  # fmt: skip
def test_decide_circuit_breaker(
    policy: SchedulePolicy, observation: Observation, expected: list[Action]
) -> None:
    assert decide(policy, observation) == expected


def test_breaker_never_admits_while_paused() -> None:
    """Whatever else the observation holds, a running back-off never yields a StartGroups."""
    for policy in (BREAKER, BREAKER_ASYNC, VALIDATING_BREAKER):
        for failures in (0, 7, 8, 100):
            for running in (0, 1, 2):
                for ready in ((), ("g0",), ("g0", "g1")):
                    observation = obs(admissions_paused=True, consecutive_failures=failures,
                                      running_groups=running, running_rollouts=4 * running,
                                      ready_groups=ready, admitted_groups=running + len(ready))  # fmt: skip
                    actions = decide(policy, observation)
                    assert not any(isinstance(a, StartGroups | PauseAdmissions) for a in actions), actions


def test_negative_breaker_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="breaker_failures"):
        SchedulePolicy(batch_groups=1, group_size=1, breaker_failures=-1)


GIVES_UP = SchedulePolicy(batch_groups=2, group_size=4, max_steps=3, mode="sync", breaker_failures=8,
                          breaker_max_trips=3)  # fmt: skip
GIVES_UP_SPLIT = SchedulePolicy(batch_groups=2, group_size=4, max_steps=10, mode="split", eta=1,
                                breaker_failures=8, breaker_max_trips=3)  # fmt: skip
CRASHED = "AgentFailed: agent exit code 1: fatal: no OPENAI_API_KEY that works"
GAVE_UP = Stop(
    "the circuit breaker tripped 3 times in a row (breaker_max_trips) with no training rollout "
    f"finished; last failure: {CRASHED}",
    failure=True,
)


@pytest.mark.parametrize(
    ("policy", "observation", "expected"),
    [
        # Fewer trips in a row than the limit: the back-off runs, then admissions resume.
        (GIVES_UP, obs(breaker_trips=2, admissions_paused=True, last_failure=CRASHED), []),
        (GIVES_UP, obs(breaker_trips=2, last_failure=CRASHED), [StartGroups(2)]),
        # The trip that would be the last is the stop itself, not a pause before it.
        (GIVES_UP, obs(breaker_trips=2, consecutive_failures=8, last_failure=CRASHED), [GAVE_UP]),
        (GIVES_UP, obs(breaker_trips=1, consecutive_failures=8, last_failure=CRASHED), [PauseAdmissions(8)]),
        # The trip that reaches the limit: the run stops naming the last failure, back-off or not,
        # rollouts running or not (they are cancelled by the stop).
        (GIVES_UP, obs(breaker_trips=3, admissions_paused=True, last_failure=CRASHED), [GAVE_UP]),
        (GIVES_UP, obs(breaker_trips=3, running_groups=1, running_rollouts=4, admitted_groups=1,
                       last_failure=CRASHED), [GAVE_UP]),
        (GIVES_UP, obs(breaker_trips=4, last_failure=CRASHED),
         [replace(GAVE_UP, reason=GAVE_UP.reason.replace("3 times", "4 times"))]),
        # ... once a validation round in flight has ended.
        (GIVES_UP, obs(breaker_trips=3, validation_open=2, validation_running=1), []),
        # An operator's stop is a stop, not a failure.
        (GIVES_UP, obs(breaker_trips=3, stopping=True), [Stop("stop requested")]),
        # 0: never gives up (the default of a policy; the config's is 5).
        (BREAKER, obs(breaker_trips=100, last_failure=CRASHED), [StartGroups(2)]),
        # Split mode: nothing more is admitted beside the step; the stop comes when it ends.
        (GIVES_UP_SPLIT, obs(phase="train", breaker_trips=3, admitted_groups=2), []),
        (GIVES_UP_SPLIT, obs(breaker_trips=3, admitted_groups=2, last_failure=CRASHED), [GAVE_UP]),
    ],
)  # fmt: skip
def test_decide_breaker_gives_up_after_max_trips(
    policy: SchedulePolicy, observation: Observation, expected: list[Action]
) -> None:
    assert decide(policy, observation) == expected


def test_a_stop_that_is_no_failure_says_so() -> None:
    assert not Stop("reached step 3").failure
    with pytest.raises(ValueError, match="breaker_max_trips"):
        SchedulePolicy(batch_groups=1, group_size=1, breaker_max_trips=-1)
