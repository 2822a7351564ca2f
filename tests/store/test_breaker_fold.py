"""The circuit breaker's state, folded from the log: failures in a row and the last trip."""

from __future__ import annotations

import pytest

from store.events import (
    AdmissionsPaused,
    ApplianceStarted,
    Event,
    LLMCallRefused,
    RolloutCreated,
    RolloutFinished,
)
from store.projections import RunState, one_line

CRASH = "AgentFailed: agent exit code 1\nTraceback (most recent call last):\nValueError: boom"


def created(rollout: str, purpose: str = "train") -> RolloutCreated:
    return RolloutCreated(
        ts=0.0,
        rollout=rollout,
        task_id="t",
        group=rollout.split("-")[0],
        task={},
        policy_version=0,
        adapter="command",
        purpose=purpose,
    )


def failed(rollout: str, error: str = CRASH, ts: float = 0.0) -> RolloutFinished:
    return RolloutFinished(ts=ts, rollout=rollout, status="failed", error=error)


def finished(rollout: str) -> RolloutFinished:
    return RolloutFinished(ts=0.0, rollout=rollout, status="finished")


def trip(ts: float, backoff_s: float = 10.0, trips: int = 1, failures: int = 3) -> AdmissionsPaused:
    return AdmissionsPaused(ts=ts, failures=failures, backoff_s=backoff_s, cause=CRASH, trips=trips)


def fold(*events: Event) -> RunState:
    return RunState.from_events(events)


def failures(*rollouts: str, error: str = CRASH) -> list[Event]:
    out: list[Event] = []
    for rollout in rollouts:
        out += [created(rollout), failed(rollout, error)]
    return out


def test_failed_training_rollouts_count_in_a_row_with_the_last_reason() -> None:
    state = fold(*failures("g0-r0", "g0-r1"), *failures("g1-r0", error="timed out after 5 s"))
    assert state.consecutive_failures == 3
    assert state.last_failure == "timed out after 5 s"
    assert state.admissions_paused is None and state.breaker_trips == 0


def test_a_finished_rollout_resets_the_count() -> None:
    state = fold(*failures("g0-r0", "g0-r1"), created("g1-r0"), finished("g1-r0"), *failures("g2-r0"))
    assert state.consecutive_failures == 1


@pytest.mark.parametrize(
    "error",
    [
        "interrupted: the appliance stopped while the rollout was running",
        "cancelled: the appliance stopped",
    ],
)
def test_failures_from_a_stop_or_restart_do_not_count(error: str) -> None:
    state = fold(*failures("g0-r0"), *failures("g0-r1", "g0-r2", error=error))
    assert state.consecutive_failures == 1
    assert state.last_failure == CRASH


def test_validation_rollouts_neither_count_nor_reset() -> None:
    state = fold(
        *failures("g0-r0", "g0-r1"),
        created("v0000-t000", purpose="validation"),
        failed("v0000-t000"),
        created("v0000-t001", purpose="validation"),
        finished("v0000-t001"),
    )
    assert state.consecutive_failures == 2


def test_an_unknown_rollout_is_ignored() -> None:
    assert fold(failed("nobody")).consecutive_failures == 0


def test_a_trip_resets_the_count_and_records_the_back_off() -> None:
    state = fold(*failures("g0-r0", "g0-r1", "g0-r2"), trip(100.0), *failures("g1-r0"))
    assert state.consecutive_failures == 1  # the next trip needs as many failures again
    assert state.admissions_paused == trip(100.0)
    assert state.breaker_trips == 1


def test_trips_in_a_row_last_until_a_rollout_finishes() -> None:
    events = [*failures("g0-r0"), trip(100.0), *failures("g1-r0"), trip(120.0, 20.0, trips=2)]
    assert fold(*events).breaker_trips == 2
    reset = fold(*events, created("g2-r0"), finished("g2-r0"))
    assert reset.breaker_trips == 0
    assert reset.consecutive_failures == 0
    # The last trip stays known (its back-off is a time window), the count of trips does not.
    assert reset.admissions_paused == trip(120.0, 20.0, trips=2)


def test_the_back_off_is_a_window_from_the_trip() -> None:
    state = fold(trip(100.0, backoff_s=10.0))
    assert state.admissions_paused_at(100.0) == trip(100.0)
    assert state.admissions_paused_at(109.9) == trip(100.0)
    assert state.admissions_paused_at(110.0) is None
    assert fold().admissions_paused_at(100.0) is None


def test_the_fold_is_the_same_one_event_at_a_time() -> None:
    events = [*failures("g0-r0", "g0-r1"), trip(5.0), *failures("g1-r0"), created("g2-r0"), finished("g2-r0")]
    incremental = RunState()
    for event in events:
        incremental.apply(event)
    assert incremental == fold(*events)


def test_one_line_keeps_the_reason_and_the_end_of_the_detail() -> None:
    assert (
        one_line(CRASH)
        == "AgentFailed: agent exit code 1: Traceback (most recent call last): | ValueError: boom"
    )
    assert one_line("timed out after 5 s") == "timed out after 5 s"
    assert one_line("AgentFailed: exit code 1:\nboom") == "AgentFailed: exit code 1: boom"  # one colon
    assert one_line("") == ""
    long = one_line("AgentFailed: agent exit code 1\n" + "x" * 1000 + "\nlast words", limit=100)
    assert len(long) <= 100
    assert long.startswith("AgentFailed: agent exit code 1: ...")
    assert long.endswith("last words")


def started(ts: float = 0.0) -> ApplianceStarted:
    return ApplianceStarted(
        ts=ts, run_id="run", model="tiny", engine="torch", resumed_from_version=0, resumed_from_step=0
    )


def test_a_start_clears_the_trips_in_a_row_and_the_back_off() -> None:
    """A run the breaker stopped (``breaker_max_trips``) resumes: the next start counts its trips
    from 0, and the last back-off does not hold it back."""
    events = [started(), *failures("g0-r0"), trip(100.0), *failures("g1-r0"), trip(120.0, 20.0, trips=2)]
    state = fold(*events, started(130.0))
    assert state.breaker_trips == 0
    assert state.admissions_paused is None and state.admissions_paused_at(130.0) is None
    assert state.last_failure == CRASH  # still what the status shows
    # The next trip is the first in a row again.
    assert fold(*events, started(130.0), *failures("g2-r0"), trip(140.0)).breaker_trips == 1


def test_refused_calls_are_counted_per_rollout_and_their_failure_counts_for_the_breaker() -> None:
    refusal = LLMCallRefused(
        ts=0.0,
        rollout="g0-r0",
        route="/chat/completions",
        status=400,
        code="context_length_exceeded",
        error_type="invalid_request_error",
        message="This model's maximum context length is 2048 tokens.",
    )
    reason = "every model call was refused: 2 of 2 (context_length_exceeded: This model's ...)"
    state = fold(created("g0-r0"), refusal, refusal, failed("g0-r0", reason), refusal)
    view = state.rollouts["g0-r0"]
    assert view.refused_calls == 3 and view.call_count == 0
    assert view.last_refusal == "context_length_exceeded: This model's maximum context length is 2048 tokens."
    assert (state.consecutive_failures, state.last_failure) == (1, reason)
    assert not RunState.trainable(view)
    assert fold(refusal).rollouts == {}  # a rollout never created: ignored
