"""The words every view uses for rollouts: their state, and why they failed, grouped."""

from __future__ import annotations

from store.outcomes import (
    NO_REASON,
    NO_REWARD,
    count_text,
    failures_text,
    grouped_reasons,
    reason_of,
    state_counts,
    state_of,
)
from store.projections import RolloutView

TRACEBACK = "AgentFailed: agent exit code 1:\nTraceback (most recent call last):\n  File x\nValueError: boom"


def view(rollout: str, status: str = "failed", error: str = "", **fields: object) -> RolloutView:
    made = RolloutView(
        rollout=rollout, task_id=f"t-{rollout}", group="g", task={}, adapter="python", created_version=0
    )
    made.status, made.error = status, error
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def test_reasons_are_grouped_most_frequent_first_each_on_one_line() -> None:
    views = [view(f"a{i}", error="timed out after 120 s") for i in range(5)]
    views += [view("b", error=TRACEBACK), view("c"), view("d", status="finished", reward=1.0)]
    assert grouped_reasons(views) == [
        ("timed out after 120 s", 5),
        (
            "AgentFailed: agent exit code 1: Traceback (most recent call last): | File x | ValueError: boom",
            1,
        ),
        (NO_REASON, 1),
    ]
    assert failures_text(views[:5]) == "failed 5: timed out after 120 s x5"
    assert failures_text([]) == "failed 0"


def test_past_three_reasons_the_rest_are_counted_together() -> None:
    groups = [("a", 4), ("b", 3), ("c", 2), ("d", 1), ("e", 1)]
    assert count_text(11, groups) == "failed 11: a x4; b x3; c x2; +2 other reasons x2"


def test_a_rollout_finished_without_a_reward_says_so_and_a_rewarded_one_has_no_reason() -> None:
    assert reason_of(view("x", status="finished")) == NO_REWARD
    assert reason_of(view("y", status="finished", reward=0.0)) == ""
    assert reason_of(view("z", status="running")) == ""


def test_an_external_rollout_is_offered_until_a_runner_claims_it() -> None:
    offered = view("o", status="running", adapter="external")
    claimed = view("c", status="running", adapter="external", claimed=True)
    own = view("p", status="running")
    assert [state_of(v) for v in (offered, claimed, own)] == ["offered", "running", "running"]
    assert state_counts([offered, claimed, own, view("f")]) == {
        "offered": 1,
        "running": 2,
        "finished": 0,
        "failed": 1,
    }
