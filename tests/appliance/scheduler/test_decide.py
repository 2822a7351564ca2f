from __future__ import annotations

import pytest

from appliance.scheduler.decide import Action, Observation, SchedulePolicy, StartGroups, Stop, Train, decide

POLICY = SchedulePolicy(batch_groups=2, group_size=4, max_steps=3)


@pytest.mark.parametrize(
    ("obs", "expected"),
    [
        # Nothing running, nothing ready: start a whole batch.
        (Observation(running_groups=0, ready_groups=(), step=0), [StartGroups(2)]),
        # One group running, none ready: top up to the batch.
        (Observation(running_groups=1, ready_groups=(), step=0), [StartGroups(1)]),
        # One ready, one running: the batch is covered; wait.
        (Observation(running_groups=1, ready_groups=("g0",), step=0), []),
        # Batch ready but a group still running (left over): sync waits for it to end.
        (Observation(running_groups=1, ready_groups=("g0", "g1"), step=0), []),
        # Batch ready, nothing in flight: train the oldest groups.
        (Observation(running_groups=0, ready_groups=("g0", "g1", "g2"), step=1), [Train(("g0", "g1"))]),
        # Step target reached: stop even with work ready.
        (Observation(running_groups=0, ready_groups=("g0", "g1"), step=3), [Stop("reached step 3")]),
        # Stop requested wins over everything.
        (Observation(running_groups=2, ready_groups=(), step=0, stopping=True), [Stop("stop requested")]),
    ],
)
def test_decide_table(obs: Observation, expected: list[Action]) -> None:
    assert decide(POLICY, obs) == expected


def test_no_step_limit_never_stops_by_itself() -> None:
    policy = SchedulePolicy(batch_groups=1, group_size=2, max_steps=None)
    assert decide(policy, Observation(running_groups=0, ready_groups=("g",), step=10_000)) == [Train(("g",))]
