"""The dashboard's view-model folded from the hand-built run (no Textual involved)."""

from __future__ import annotations

import pytest

from store.events import LLMCallCompleted, TrainStepCompleted
from tests.tui.run_events import run_events
from tui.model import VALIDATION, DashboardModel, RolloutFilter, describe


def folded() -> DashboardModel:
    model = DashboardModel()
    for position, event in enumerate(run_events(), start=1):
        model.apply(event, position)
    return model


def test_timeline_alternates_generate_switch_train_with_durations() -> None:
    model = folded()
    phases = [span.phase for span in model.timeline]
    assert phases == ["generate", "switch", "train", "switch"] * 2 + ["generate", "idle"]
    train = [span for span in model.timeline if span.phase == "train"]
    assert [round(span.duration(model.last_ts), 6) for span in train] == [1.5, 1.5]
    # The switch around a step: drain + sleep + onload before; offload + push after, until the
    # scheduler's PhaseChanged("generate") 10 ms later.
    switches = [round(s.duration(model.last_ts), 3) for s in model.timeline if s.phase == "switch"]
    assert switches == [0.35, 0.51, 0.35, 0.51]
    totals = model.phase_totals(model.last_ts)
    assert totals["train"] == pytest.approx(3.0)
    assert model.timeline[-1].end is None  # idle, open until now


def test_counts_rates_and_staleness() -> None:
    model = folded()
    counts = model.counts()
    # The two rollouts under way are "running" as ``status`` counts them, calls or not.
    assert (counts.offered, counts.running, counts.finished, counts.failed) == (0, 2, 7, 1)
    assert counts.awaiting_training == 0
    calls = [e for e in run_events() if isinstance(e, LLMCallCompleted)]
    now = calls[-1].ts
    recent = [c for c in calls if c.ts >= now - 30.0]
    calls_s, tokens_s = model.rates(now)
    span = min(30.0, now - model.first_ts)
    assert calls_s == pytest.approx(len(recent) / span)
    assert tokens_s == pytest.approx(sum(len(c.response_ids) for c in recent) / span)
    assert model.rates(now + 3600) == (0.0, 0.0)  # nothing in the window any more
    assert model.staleness() == {"staleness_mean": 0.25, "stale_tokens": 2.0, "stale_tokens_dropped": 0.0}
    assert model.state.paused and model.stopped == "requested"


def test_curves_follow_the_steps_and_validation() -> None:
    model = folded()
    steps = [e for e in run_events() if isinstance(e, TrainStepCompleted)]
    assert model.curves["loss"] == [(s.step, s.metrics["loss"]) for s in steps]
    assert model.curves["ppo_kl"] == [(1, 0.01), (2, 0.02)]
    assert [(step, round(value, 6)) for step, value in model.curves[VALIDATION]] == [(1, 0.6), (2, 0.8)]


def test_rows_newest_first_and_filters() -> None:
    model = folded()
    rows = model.rows()
    assert [r.rollout for r in rows][:3] == ["r-4-1", "r-4-0", "r-3-1"]
    assert [r.rollout for r in model.rows(RolloutFilter(status="failed"))] == ["r-3-1"]
    assert {r.task_id for r in model.rows(RolloutFilter(task="ADD-2"))} == {"add-2"}
    high = model.rows(RolloutFilter(min_reward=0.5))
    assert high and all(r.reward is not None and r.reward >= 0.5 for r in high)
    low = model.rows(RolloutFilter(max_reward=0.0))
    assert {r.rollout for r in low} == {"r-0-1", "r-2-0"}
    assert [r.rollout for r in model.rows(RolloutFilter(status="finished"), limit=2)] == ["r-3-0", "r-2-1"]
    (row,) = [r for r in rows if r.rollout == "r-1-1"]
    assert (row.calls, row.sampled, row.trained_step, row.duration_s) == (2, 8, 1, 0.7)


def test_tail_filters_by_type_and_text_and_keeps_order() -> None:
    model = folded()
    steps = model.tail(["TrainStepCompleted"])
    assert [line.text.split(":")[0] for line in steps] == ["step 1", "step 2"]
    assert [line.position for line in model.tail(text="r-3-1")] == sorted(
        line.position for line in model.tail(text="r-3-1")
    )
    assert all("r-3-1" in line.rollout for line in model.tail(text="r-3-1"))
    assert len(model.tail(limit=5)) == 5 and model.tail(limit=1)[0].type == "ApplianceStopped"


def test_every_event_has_a_line() -> None:
    for event in run_events():
        text = describe(event)
        assert text and text != event.type
