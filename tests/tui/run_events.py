"""A hand-built, deterministic run for the dashboard's snapshots and fold tests.

Two training steps of two groups of two rollouts, two calls each (the second call extends the
first, so each rollout merges into one sample), one failed rollout, a validation round, a
preempted call whose tokens span two policy versions, a checkpoint and operator controls. Every
``ts`` is fixed, so screenshots never change.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from store.events import (
    ApplianceStarted,
    ApplianceStopped,
    CallRewardReported,
    CheckpointSaved,
    ControlRequested,
    Event,
    LLMCallCompleted,
    PhaseChanged,
    PolicyVersionPublished,
    RewardReported,
    RolloutCreated,
    RolloutFinished,
    SwitchPhaseCompleted,
    TrainStepCompleted,
    ValidationCompleted,
)
from store.eventstore import EventStore
from store.tokens import Tokens

T0 = 1_780_000_000.0
SWITCH = (("drain", 0.05), ("sleep", 0.1), ("onload", 0.2), ("train", 1.5), ("offload", 0.2), ("push", 0.3))


def _call(rollout: str, index: int, t: float, version: int, prompt: Sequence[int]) -> LLMCallCompleted:
    response = tuple(100 + index * 10 + k for k in range(4))
    versions = (version, version, version + 1, version + 1) if rollout == "r-1-1" and index == 1 else ()
    question = f"What is {index + 3} + 4?"
    return LLMCallCompleted(
        ts=t,
        rollout=rollout,
        call_id=f"{rollout}-c{index}",
        surface="openai.chat",
        prompt_ids=Tokens(prompt),
        response_ids=Tokens(response),
        response_logprobs=(-0.25, -0.5, -1.0, -0.125),
        policy_version=version,
        finish_reason="stop",
        request={
            "messages": [{"role": "system", "content": "Answer."}, {"role": "user", "content": question}]
        },
        response_text=str(index + 7),
        queue_s=0.01,
        total_s=0.2,
        ttft_s=0.05,
        preemptions=1 if versions else 0,
        response_versions=Tokens(versions),
    )


def run_events() -> list[Event]:
    """The whole run, in log order."""
    events: list[Event] = [
        ApplianceStarted(
            ts=T0,
            run_id="run-fixture-0001",
            model="tiny",
            engine="torch",
            resumed_from_version=0,
            resumed_from_step=0,
            config={"model": "tiny", "group_size": 2, "batch_groups": 2},
        ),
        PhaseChanged(ts=T0 + 0.5, phase="generate", policy_version=0),
    ]
    t = T0 + 1.0
    rewards = {
        "r-0-0": 1.0,
        "r-0-1": 0.0,
        "r-1-0": 1.0,
        "r-1-1": 1.0,
        "r-2-0": 0.0,
        "r-2-1": 1.0,
        "r-3-0": 1.0,
    }
    for step in (1, 2):
        version = step - 1
        groups = (2 * (step - 1), 2 * (step - 1) + 1)
        for group in groups:
            for k in range(2):
                rollout = f"r-{group}-{k}"
                events.append(
                    RolloutCreated(
                        ts=t,
                        rollout=rollout,
                        task_id=f"add-{group}",
                        group=f"g{group}",
                        task={"a": group, "b": 4},
                        policy_version=version,
                        adapter="python",
                    )
                )
                t += 0.1
        for group in groups:
            for k in range(2):
                rollout = f"r-{group}-{k}"
                first = _call(rollout, 0, t, version, (1, 2, 3, 4, 5))
                events.append(first)
                second_prompt = first.prompt_ids + first.response_ids + (6, 7)
                events.append(_call(rollout, 1, t + 0.3, version, second_prompt))
                t += 0.6
                if rollout == "r-3-1":
                    events.append(RolloutFinished(ts=t, rollout=rollout, status="failed", error="timeout"))
                    continue
                events.append(RewardReported(ts=t, rollout=rollout, reward=rewards[rollout], source="agent"))
                if rollout == "r-0-0":
                    events.append(
                        CallRewardReported(
                            ts=t,
                            rollout=rollout,
                            call_id=f"{rollout}-c0",
                            reward=0.5,
                            source="http",
                            name="format",
                        )
                    )
                events.append(RolloutFinished(ts=t, rollout=rollout, status="finished", duration_s=0.7))
        events.append(PhaseChanged(ts=t, phase="train", policy_version=version))
        for phase, duration in SWITCH:
            t += duration
            events.append(SwitchPhaseCompleted(ts=t, step=step, phase=phase, duration_s=duration))
            if phase == "train":
                trained = tuple(f"r-{g}-{k}" for g in groups for k in range(2))
                events.append(
                    TrainStepCompleted(
                        ts=t,
                        step=step,
                        rollouts=trained,
                        samples=4,
                        tokens=60,
                        zero_variance_groups=1,
                        metrics={
                            "loss": 0.25 / step,
                            "grad_norm": 1.5 - 0.5 * step,
                            "entropy": 2.0 - 0.25 * step,
                            "ppo_kl": 0.01 * step,
                            "pg_clipfrac": 0.0,
                            "reward_mean": 0.5 + 0.25 * (step - 1),
                            "staleness_mean": 0.25 * (step - 1),
                            "stale_tokens": float(2 * (step - 1)),
                            "stale_tokens_dropped": 0.0,
                            "tokens_sampled": 16.0,
                            "tokens_prompt": 44.0,
                            "tokens_trained": 16.0,
                        },
                        duration_s=duration,
                    )
                )
                events.append(
                    PolicyVersionPublished(
                        ts=t, policy_version=step, step=step, checkpoint=f"checkpoints/v{step:06d}"
                    )
                )
        events.append(PhaseChanged(ts=t + 0.01, phase="generate", policy_version=step))
        events.append(
            ValidationCompleted(
                ts=t + 0.5,
                step=step,
                policy_version=step,
                rollouts=(),
                reward_mean=0.4 + 0.2 * step,
                reward_std=0.1,
                failed=0,
            )
        )
        t += 1.0
    events += [
        ControlRequested(ts=t, action="checkpoint", source="dashboard"),
        CheckpointSaved(ts=t + 0.2, step=2, policy_version=2, path="checkpoints/v000002", reason="requested"),
        RolloutCreated(
            ts=t + 0.3,
            rollout="r-4-0",
            task_id="add-4",
            group="g4",
            task={},
            policy_version=2,
            adapter="python",
        ),
        RolloutCreated(
            ts=t + 0.3,
            rollout="r-4-1",
            task_id="add-4",
            group="g4",
            task={},
            policy_version=2,
            adapter="python",
        ),
        _call("r-4-0", 0, t + 0.6, 2, (1, 2, 3, 4, 5)),
        ControlRequested(ts=t + 1.0, action="pause", source="dashboard"),
        PhaseChanged(ts=t + 1.1, phase="idle", policy_version=2),
        ApplianceStopped(ts=t + 1.2, reason="requested"),
    ]
    return events


async def write_run(path: Path, events: list[Event] | None = None) -> Path:
    """The run's events in a fresh store at ``path``."""
    async with await EventStore.open(path) as store:
        await store.append(events if events is not None else run_events())
    return path
