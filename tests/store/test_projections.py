"""RunState: a hand-written run folds into the expected state."""

from __future__ import annotations

from store import (
    ApplianceStarted,
    ApplianceStopped,
    CallRewardReported,
    CheckpointSaved,
    ControlRequested,
    EvaluationCompleted,
    Event,
    LLMCallCompleted,
    PhaseChanged,
    PolicyVersionPublished,
    RewardReported,
    RolloutCreated,
    RolloutFinished,
    RunState,
    StoredEvent,
    TrainStepCompleted,
    ValidationCompleted,
)
from store.tokens import Tokens


def started(version: int) -> ApplianceStarted:
    return ApplianceStarted(
        ts=0.0,
        run_id="run-1",
        model="tiny",
        engine="torch",
        resumed_from_version=version,
        resumed_from_step=version,
    )


def created(rollout: str, group: str, version: int = 0) -> RolloutCreated:
    return RolloutCreated(
        ts=0.0,
        rollout=rollout,
        task_id=f"task-{group}",
        group=group,
        task={"prompt": group},
        policy_version=version,
        adapter="python",
    )


def llm_call(rollout: str, n_response: int) -> LLMCallCompleted:
    return LLMCallCompleted(
        ts=0.0,
        rollout=rollout,
        call_id=f"{rollout}-{n_response}",
        surface="openai.chat",
        prompt_ids=Tokens((1, 2)),
        response_ids=Tokens(tuple(range(n_response))),
        response_logprobs=(-0.5,) * n_response,
        policy_version=0,
        finish_reason="stop",
        request={},
        response_text="",
        queue_s=0.0,
        total_s=0.0,
    )


def rewarded(rollout: str, reward: float) -> RewardReported:
    return RewardReported(ts=0.0, rollout=rollout, reward=reward, source="test")


def finished(rollout: str, status: str = "finished", error: str = "") -> RolloutFinished:
    return RolloutFinished(ts=0.0, rollout=rollout, status=status, error=error)


def step(n: int, *rollouts: str) -> TrainStepCompleted:
    return TrainStepCompleted(
        ts=0.0, step=n, rollouts=rollouts, samples=len(rollouts), tokens=10, zero_variance_groups=0
    )


RUN: list[Event] = [
    started(version=0),
    PhaseChanged(ts=0.0, phase="generate", policy_version=0),
    created("a1", "A"),
    created("a2", "A"),
    created("b1", "B"),
    created("b2", "B"),
    llm_call("a1", 3),
    llm_call("a1", 2),
    llm_call("b1", 4),
    rewarded("a1", 0.0),
    rewarded("a1", 1.0),  # the last reward counts
    finished("a1"),
    rewarded("a2", 0.5),
    finished("a2"),
    finished("b1", "failed", "harness crashed"),
    PhaseChanged(ts=0.0, phase="train", policy_version=0),
    step(1, "a1", "a2"),
    PolicyVersionPublished(ts=0.0, policy_version=1, step=1, checkpoint="ckpt/v1"),
    created("c1", "C", version=1),
    finished("c1"),
    rewarded("ghost", 1.0),  # a rollout never created: ignored
    ApplianceStopped(ts=0.0, reason="done"),
    started(version=1),
]


def test_a_run_folds_into_the_expected_state() -> None:
    state = RunState.from_events(RUN)
    assert (state.run_id, state.starts, state.phase) == ("run-1", 2, "train")
    assert (state.policy_version, state.step, state.checkpoint) == (1, 1, "ckpt/v1")
    assert list(state.rollouts) == ["a1", "a2", "b1", "b2", "c1"]
    assert [s.step for s in state.steps] == [1]

    a1, a2, b1, b2, c1 = state.rollouts.values()
    assert (a1.status, a1.reward, a1.trained_step, a1.call_count, a1.tokens_sampled) == (
        "finished",
        1.0,
        1,
        2,
        5,
    )
    assert a1.released and a1.calls == []  # trained on: the log keeps the calls, the state their counts
    assert (b1.released, b1.call_count, [c.call_id for c in b1.calls]) == (False, 1, ["b1-4"])
    assert (a2.reward, a2.trained_step) == (0.5, 1)
    assert (b1.status, b1.error, b1.reward, b1.trained_step) == ("failed", "harness crashed", None, None)
    assert (b2.status, b2.task_id, b2.group, b2.adapter) == ("running", "task-B", "B", "python")
    assert (c1.created_version, c1.task) == (1, {"prompt": "C"})
    assert "ghost" not in state.rollouts


def test_running_ready_groups_and_trainable() -> None:
    state = RunState.from_events(RUN)
    assert [v.rollout for v in state.running()] == ["b2"]
    # A is trained, B still has b2 running: only C is ready.
    assert {g: [v.rollout for v in views] for g, views in state.ready_groups().items()} == {"C": ["c1"]}

    state.apply(finished("b2"))
    state.apply(rewarded("b2", 0.25))
    ready = state.ready_groups()
    assert list(ready) == ["B", "C"]  # in order of first creation
    assert [state.trainable(v) for v in ready["B"]] == [False, True]  # b1 failed
    assert not state.trainable(state.rollouts["c1"])  # finished without a reward


def test_summary() -> None:
    summary = RunState.from_events(RUN).summary()
    assert summary == {
        "run_id": "run-1",
        "phase": "train",
        "policy_version": 1,
        "step": 1,
        "steps": 1,
        "rollouts": {"running": 1, "finished": 3, "failed": 1},
        "mean_reward": 0.75,  # a1 = 1.0 and a2 = 0.5, the rollouts of the last step
        "validation_reward": None,
        "paused": False,
        "calls": 3,
        "tokens_sampled": 9,
        "tokens_prompt": 6,  # each call's whole prompt (2 ids, 3 calls)
        "tokens_trained": 0,  # its step recorded no trained figure
    }
    assert RunState().summary()["mean_reward"] is None


def test_stored_events_record_the_position_and_fold_like_bare_ones() -> None:
    stored = [StoredEvent(position, event) for position, event in enumerate(RUN, start=1)]
    from_stored = RunState.from_events(stored)
    assert from_stored.position == len(RUN)
    from_bare = RunState.from_events(RUN)
    assert from_bare.position == 0
    from_bare.position = from_stored.position
    assert from_bare == from_stored


def test_incremental_fold_equals_batch_fold() -> None:
    state = RunState()
    for position, event in enumerate(RUN, start=1):
        state.apply(event, position)
    assert state == RunState.from_events(StoredEvent(p, e) for p, e in enumerate(RUN, start=1))


def test_validation_rollouts_are_never_ready_for_training() -> None:
    events: list[Event] = [
        created("t1", "g1"),
        RolloutCreated(
            ts=0.0,
            rollout="v1",
            task_id="held-out",
            group="val-1",
            task={},
            policy_version=0,
            adapter="python",
            purpose="validation",
        ),
        RewardReported(ts=0.0, rollout="t1", reward=1.0, source="agent"),
        RewardReported(ts=0.0, rollout="v1", reward=0.5, source="agent"),
        RolloutFinished(ts=0.0, rollout="t1", status="finished"),
        RolloutFinished(ts=0.0, rollout="v1", status="finished"),
        ValidationCompleted(
            ts=0.0, step=0, policy_version=0, rollouts=("v1",), reward_mean=0.5, reward_std=0.0, failed=0
        ),
    ]
    state = RunState.from_events(events)
    assert list(state.ready_groups()) == ["g1"]
    assert state.rollouts["v1"].purpose == "validation"
    assert state.summary()["validation_reward"] == 0.5


def test_control_call_rewards_and_checkpoints_fold() -> None:
    state = RunState.from_events(
        [
            created("a", "g"),
            CallRewardReported(ts=0.0, rollout="a", call_id="c1", reward=0.25, source="agent", name="fmt"),
            CallRewardReported(ts=0.0, rollout="a", call_id="c2", reward=0.75, source="agent"),
            ControlRequested(ts=0.0, action="pause"),
            CheckpointSaved(ts=0.0, step=3, policy_version=3, path="checkpoints/s3", reason="requested"),
        ]
    )
    assert [(r.call_id, r.reward) for r in state.rollouts["a"].call_rewards] == [("c1", 0.25), ("c2", 0.75)]
    assert state.paused
    assert state.last_checkpoint is not None and state.last_checkpoint.step == 3
    state.apply(ControlRequested(ts=0.0, action="resume"))
    assert not state.paused


def test_consumed_rollouts_release_their_calls_and_keep_their_counts() -> None:
    """Only rollouts nothing has consumed yet hold their calls: a long run's state does not grow
    with every prompt of every call (trained, validated, evaluated rollouts keep counts only)."""

    def validation(rollout: str, group: str, purpose: str) -> RolloutCreated:
        return RolloutCreated(
            ts=0.0,
            rollout=rollout,
            task_id="held-out",
            group=group,
            task={},
            policy_version=0,
            adapter="python",
            purpose=purpose,
        )

    state = RunState()
    held: list[int] = []
    for n in range(1, 6):
        rollouts = [f"s{n}-{i}" for i in range(4)]
        for rollout in rollouts:
            state.apply(created(rollout, f"G{n}"))
            for length in (3, 4, 5):
                state.apply(llm_call(rollout, length))
            state.apply(rewarded(rollout, 1.0))
            state.apply(finished(rollout))
        state.apply(created(f"next{n}", f"H{n}"))  # created and called, not yet trained
        state.apply(llm_call(f"next{n}", 2))
        held.append(sum(len(view.calls) for view in state.rollouts.values()))
        state.apply(step(n, *rollouts))
        assert all(state.rollouts[r].released and not state.rollouts[r].calls for r in rollouts)
    # Before each step: the four rollouts about to be trained plus the untrained ones so far.
    assert held == [4 * 3 + n for n in range(1, 6)]
    assert sum(len(view.calls) for view in state.rollouts.values()) == 5
    trained = state.rollouts["s3-2"]
    assert (trained.call_count, trained.tokens_sampled, trained.trained_step) == (3, 12, 3)
    summary = state.summary()
    assert (summary["calls"], summary["tokens_sampled"]) == (5 * 4 * 3 + 5, 5 * 4 * 12 + 5 * 2)

    state.apply(validation("v1", "val-1", "validation"))
    state.apply(llm_call("v1", 6))
    state.apply(validation("e1", "eval-1", "evaluation"))
    state.apply(llm_call("e1", 7))
    assert [len(state.rollouts[r].calls) for r in ("v1", "e1")] == [1, 1]
    state.apply(
        ValidationCompleted(
            ts=0.0, step=5, policy_version=5, rollouts=("v1",), reward_mean=0.0, reward_std=0.0, failed=1
        )
    )
    state.apply(
        EvaluationCompleted(
            ts=0.0,
            step=5,
            policy_version=5,
            split="test",
            repeat=1,
            rollouts=("e1",),
            reward_mean=0.0,
            reward_std=0.0,
            failed=1,
        )
    )
    for rollout, tokens in (("v1", 6), ("e1", 7)):
        view = state.rollouts[rollout]
        assert (view.released, view.calls, view.call_count, view.tokens_sampled) == (True, [], 1, tokens)
    state.apply(llm_call("s1-0", 9))  # a late call of a released rollout is counted, not held
    assert (state.rollouts["s1-0"].call_count, state.rollouts["s1-0"].calls) == (4, [])
