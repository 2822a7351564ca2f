"""Validation rounds: held-out tasks, evaluation sampling, never trained on, recorded per round."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from appliance.app import Appliance
from appliance.rollouts.validation import (
    arithmetic_training_tasks,
    arithmetic_validation_tasks,
    training_tasks,
    validation_tasks,
)
from store.events import (
    LLMCallCompleted,
    RolloutCreated,
    TrainStepCompleted,
    ValidationCompleted,
)
from tests.support import make_config


def test_arithmetic_held_out_pairs_never_reach_training() -> None:
    held_out = {(t.data["a"], t.data["b"]) for t in arithmetic_validation_tasks(seed=3)}
    assert 5 <= len(held_out) <= 40
    trained = {(t.data["a"], t.data["b"]) for t in itertools.islice(arithmetic_training_tasks(seed=3), 3000)}
    assert trained.isdisjoint(held_out)
    assert len(trained) == 100 - len(held_out), "every other pair is trained on"
    # Resumable: position k of the stream is what a stream started at k yields first.
    full = list(itertools.islice(arithmetic_training_tasks(seed=3), 12))
    assert list(itertools.islice(arithmetic_training_tasks(seed=3, start=7), 5)) == full[7:]
    # The same tasks every round, in a seeded order.
    assert arithmetic_validation_tasks(seed=3) == arithmetic_validation_tasks(seed=3)


def test_task_set_validation_split_is_disjoint_and_missing_split_turns_validation_off(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    split = tmp_path / "split.jsonl"
    split.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "split": "validation" if i % 4 == 0 else "train", "q": i}) + "\n"
            for i in range(20)
        )
    )
    config = make_config(tmp_path, tiny_model_dir, tasks=split, validate_every=2, validation_tasks=3)
    held_out = validation_tasks(config)
    assert len(held_out) == 3
    assert all(int(t.id[1:]) % 4 == 0 for t in held_out)
    trained = {t.id for t in itertools.islice(training_tasks(config, 0), 50)}
    assert trained.isdisjoint(t.id for t in held_out)

    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(5)))
    assert validation_tasks(make_config(tmp_path, tiny_model_dir, tasks=plain, validate_every=2)) == []


async def test_rounds_at_step_zero_and_every_n_steps_with_evaluation_sampling(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(
        tmp_path,
        tiny_model_dir,
        max_steps=2,
        batch_groups=1,
        validate_every=2,
        validation_tasks=3,
        validation_temperature=0.0,
        validation_max_tokens=5,
        temperature=1.0,
    )
    async with Appliance(config) as app:
        assert await app.run() == "reached step 2"
        stored = await app.store.read()
        state = app.live.state

    events = [s.event for s in stored]
    rounds = [e for e in events if isinstance(e, ValidationCompleted)]
    assert [(r.step, r.policy_version) for r in rounds] == [(0, 0), (2, 2)]
    validation = {e.rollout for e in events if isinstance(e, RolloutCreated) and e.purpose == "validation"}
    assert len(validation) == 6
    assert {r for rnd in rounds for r in rnd.rollouts} == validation
    held_out_ids = {t.id for t in arithmetic_validation_tasks(seed=config.seed)[:3]}
    for rnd in rounds:
        assert {state.rollouts[r].task_id for r in rnd.rollouts} == held_out_ids, "the same tasks each round"
        assert rnd.failed == sum(1 for r in rnd.rollouts if state.rollouts[r].reward is None)
        assert rnd.sampling["temperature"] == 0.0 and rnd.sampling["max_tokens"] == 5

    # Evaluation sampling on validation calls, the training rules on the others.
    calls = [e for e in events if isinstance(e, LLMCallCompleted)]
    assert {c.rollout for c in calls} >= validation
    for call in calls:
        if call.rollout in validation:
            # Whatever the agent asked for (it asks for 16 tokens at the default temperature).
            assert call.request["max_tokens"] != 5
            assert (call.sampling["temperature"], call.sampling["max_tokens"]) == (0.0, 5)
        else:
            assert call.sampling["temperature"] == 1.0 and call.sampling["max_tokens"] != 5

    # Never trained on, and no step ran while a round was open.
    trained = {r for e in events if isinstance(e, TrainStepCompleted) for r in e.rollouts}
    assert trained and trained.isdisjoint(validation)
    step_positions = [s.position for s in stored if isinstance(s.event, TrainStepCompleted)]
    for rnd in rounds:
        opened = min(
            s.position
            for s in stored
            if isinstance(s.event, RolloutCreated) and s.event.rollout in rnd.rollouts
        )
        (closed,) = [s.position for s in stored if s.event is rnd]
        assert not any(opened < p < closed for p in step_positions)
    assert state.summary()["validation_reward"] == rounds[-1].reward_mean
