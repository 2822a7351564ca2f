"""The rollout controller's verdict on a rollout's model calls (``calls_verdict``), as a table."""

from __future__ import annotations

from typing import cast

import pytest

from appliance.chat.transcript import Transcript
from appliance.rollouts.controller import calls_verdict
from appliance.rollouts.registry import ActiveRollout

NO_CALL = "made no model call: the agent ended without calling the model (nothing to train on)"
LAST = "context_length_exceeded: This model's maximum context length is 2048 tokens."


def rollout(calls: int, refused: int = 0, unavailable: int = 0) -> ActiveRollout:
    return ActiveRollout(
        rollout="g000000-r0",
        task_id="t",
        group="g000000",
        token="k",
        transcript=cast(Transcript, None),  # not read
        calls=calls,
        refused=refused,
        unavailable=unavailable,
        last_refusal=LAST if refused else "",
    )


@pytest.mark.parametrize(
    ("active", "fraction", "verdict"),
    [
        # Every call refused: failed, whatever the threshold, retryable answers included.
        (rollout(0, 4), 0.5, f"every model call was refused: 4 of 4 ({LAST})"),
        (rollout(0, 1), 1.0, f"every model call was refused: 1 of 1 ({LAST})"),
        (rollout(0, 2, unavailable=2), 0.5, f"every model call was refused: 2 of 2 ({LAST})"),
        # No call at all.
        (rollout(0), 0.5, NO_CALL),
        # More than the fraction refused.
        (rollout(1, 2), 0.5,
         f"2 of 3 model calls were refused, more than max_refused_fraction (0.5); last: {LAST}"),
        (rollout(3, 1), 0.2,
         f"1 of 4 model calls were refused, more than max_refused_fraction (0.2); last: {LAST}"),
        (rollout(1, 1), 0.0,
         f"1 of 2 model calls were refused, more than max_refused_fraction (0); last: {LAST}"),
        # At or under it: fine.
        (rollout(1, 1), 0.5, ""),
        (rollout(3, 1), 0.25, ""),
        (rollout(1, 5), 1.0, ""),
        (rollout(2), 0.0, ""),
        # Retryable answers (the appliance busy) are left out of the fraction.
        (rollout(1, 3, unavailable=3), 0.5, ""),
        (rollout(1, 3, unavailable=1), 0.5,
         f"2 of 3 model calls were refused, more than max_refused_fraction (0.5); last: {LAST}"),
    ],
)  # fmt: skip
def test_calls_verdict(active: ActiveRollout, fraction: float, verdict: str) -> None:
    assert calls_verdict(active, fraction) == verdict
