"""The tracked figures folded from events (``appliance.reporting.rows``): one row per step at the
version it published, closed when its switch ends, with the cycle's times; validation and
evaluation rows at the version they ran on; a restart starts a new cycle."""

from __future__ import annotations

import pytest

from appliance.reporting.rows import Row, StepRows
from store.events import (
    ApplianceStarted,
    EvaluationCompleted,
    Event,
    PhaseChanged,
    PolicyVersionPublished,
    RolloutFinished,
    SwitchPhaseCompleted,
    TrainStepCompleted,
    ValidationCompleted,
)


def fold(events: list[Event], rows: StepRows | None = None) -> list[Row]:
    rows = rows or StepRows()
    out: list[Row] = []
    for position, event in enumerate(events, 1):
        out += rows.apply(event, position)
    return out


def started(ts: float, version: int = 0) -> ApplianceStarted:
    return ApplianceStarted(
        ts=ts,
        run_id="r",
        model="tiny",
        engine="torch",
        resumed_from_version=version,
        resumed_from_step=version,
    )


def step(ts: float, n: int, **metrics: float) -> TrainStepCompleted:
    return TrainStepCompleted(
        ts=ts, step=n, rollouts=("a", "b"), samples=3, tokens=40, zero_variance_groups=0,
        metrics={"loss": 0.5, "staleness_max": 1.0, "is_weight_mean": 1.0, "tokens_sampled": 30.0,
                 "tokens_prompt": 50.0, "tokens_trained": 24.0, **metrics},
        duration_s=2.0, sampled=(10, 20), rewards=(1.0, 0.5),
    )  # fmt: skip


def switch(ts: float, n: int, version: int) -> list[Event]:
    """A collocated switch: drain 1 s, sleep 1 s, train 2 s (the step), push 1 s."""
    return [
        PhaseChanged(ts=ts, phase="train", policy_version=version - 1),
        SwitchPhaseCompleted(ts=ts + 1, step=n, phase="drain", duration_s=1.0),
        SwitchPhaseCompleted(ts=ts + 2, step=n, phase="sleep", duration_s=1.0),
        step(ts + 4, n),
        PolicyVersionPublished(ts=ts + 4, policy_version=version, step=n, checkpoint="c"),
        SwitchPhaseCompleted(ts=ts + 4, step=n, phase="train", duration_s=2.0),
        SwitchPhaseCompleted(ts=ts + 5, step=n, phase="push", duration_s=1.0),
        PhaseChanged(ts=ts + 5, phase="generate", policy_version=version),
    ]


def test_a_step_row_closes_with_its_switch_at_the_version_it_published() -> None:
    finished = [RolloutFinished(ts=100.0 + i, rollout=f"r{i}", status="finished") for i in range(4)]
    rows = fold([started(90.0), *finished, *switch(110.0, 1, 1)])
    assert len(rows) == 1
    row = rows[0]
    assert (row.step, row.position) == (1, 13)  # the PhaseChanged "generate" closed it
    values = row.values
    assert values["train/policy_loss"] == 0.5
    assert values["staleness/max"] == 1.0
    assert values["train/is_weight_mean"] == 1.0  # a metric without its own name: under train/
    assert values["train/samples"] == 3.0 and values["train/step"] == 1.0
    # The token figures by their one name each (store.token_figures); the sequences' length is none.
    assert (values["tokens/sampled"], values["tokens/trained"], values["tokens/prompt"]) == (30.0, 24.0, 50.0)
    assert "train/tokens" not in values
    assert values["time/step_s"] == 2.0 and values["time/train_s"] == 2.0
    assert values["time/switch_s"] == 3.0  # drain + sleep + push
    assert values["time/cycle_s"] == pytest.approx(25.0)  # start (90) to the switch's end (115)
    assert values["time/generate_s"] == pytest.approx(20.0)  # the cycle less the switch and the step
    assert values["throughput/rollouts_per_s"] == pytest.approx(4 / 25.0)
    # The step's rollouts' sampled tokens over the cycle's generation time; their distributions.
    assert values["throughput/generation_tokens_per_s"] == pytest.approx(30 / 20.0)
    assert row.histograms == {"reward/train": (1.0, 0.5), "rollout/sampled_tokens": (10.0, 20.0)}


def test_validation_and_evaluation_rows_sit_at_the_version_they_ran_on() -> None:
    rows = fold(
        [
            started(0.0),
            ValidationCompleted(
                ts=1.0, step=0, policy_version=0, rollouts=("v1", "v2"), reward_mean=0.25, reward_std=0.5,
                failed=1,
            ),
            *switch(2.0, 1, 1),
            EvaluationCompleted(
                ts=9.0, step=1, policy_version=1, split="test", repeat=1, rollouts=("e",), reward_mean=0.75,
                reward_std=0.0, failed=0,
            ),
        ]
    )  # fmt: skip
    assert [(r.step, sorted(r.values)[:2]) for r in rows if "train/step" not in r.values] == [
        (0, ["reward/validation_mean", "reward/validation_std"]),
        (1, ["evaluation/failed", "evaluation/rollouts"]),
    ]
    assert rows[0].values["validation/failed"] == 1.0
    assert rows[-1].values["reward/evaluation_mean"] == 0.75


def test_a_restart_resumes_the_axis_and_a_crash_leaves_out_the_downtime() -> None:
    rows = StepRows()
    first = fold([started(0.0), *switch(10.0, 1, 1)[:5]], rows)  # crashed before the switch ended
    assert first == []
    after = fold([started(500.0, version=1), *switch(510.0, 2, 2)], rows)
    crashed, resumed = after
    assert crashed.step == 1 and "time/push_s" not in crashed.values
    assert crashed.values["time/cycle_s"] == pytest.approx(14.0)  # up to its last event, not the restart
    assert resumed.step == 2 and resumed.values["time/cycle_s"] == pytest.approx(15.0)
