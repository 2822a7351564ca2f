"""Split placement in the live appliance: steps run beside generation, never sleeping the engine.

On CPU the engine and the trainer share the processor, but the schedule is the split one: the
proxy keeps serving while a step trains, and the new weights reach the engine by a push at the
end of each step (generation pauses for the push alone). The placement plan refuses split
without GPUs (``appliance.placement.plan``): these tests skip that check, not the schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appliance.app import Appliance
from appliance.training.service import TrainedStep
from store.codec import StoredEvent
from store.events import (
    LLMCallCompleted,
    PhaseChanged,
    RolloutCreated,
    SwitchPhaseCompleted,
    TrainStepCompleted,
    TrainStepFailed,
)
from store.projections import RunState
from tests.support import make_config

#: Guards the wait for generation beside the first step: past it the step goes on anyway and the
#: assertions below fail (it is no timing assertion: the wait ends as soon as a call completes).
GUARD_S = 120.0


def _new_call_since(stored: Sequence[StoredEvent], position: int) -> bool:
    """A rollout admitted after ``position`` made a model call after it."""
    created = {
        s.event.rollout for s in stored if s.position > position and isinstance(s.event, RolloutCreated)
    }
    return any(
        s.position > position and isinstance(s.event, LLMCallCompleted) and s.event.rollout in created
        for s in stored
    )


async def test_split_run_serves_while_it_trains_and_never_sleeps(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # One group per step and one group in flight at a time, eta 2: when g0 is trained, the
    # bound lets g1 (and g2) start beside the step.
    eta = 2
    config = make_config(
        tmp_path,
        tiny_model_dir,
        placement="split",
        mode="async",
        eta=eta,
        max_steps=3,
        batch_groups=1,
        group_size=2,
        max_inflight_rollouts=2,
    )
    async with Appliance(config) as app:
        assert app.runner is not None and app.runner.policy.mode == "split"
        slept: list[int] = []

        async def no_sleep(level: int = 1) -> None:
            slept.append(level)

        app.engine.sleep = no_sleep  # type: ignore[method-assign]

        real_train = app.training.train
        first_step: list[int] = []  # the store's position when the first step began
        versions: list[tuple[int, int]] = []  # (published, observed) when each step's events are in

        async def train(state: RunState, groups: Sequence[str], **options: Any) -> TrainedStep:
            if not first_step:
                # Hold the first step until generation happened beside it: a rollout admitted
                # after it began made a call. Collocated, nothing is admitted or served now.
                first_step.append(app.store.last_position)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(GUARD_S):
                        while not _new_call_since(await app.store.read(after=first_step[0]), first_step[0]):
                            await app.live.wait_change(app.live.position)
            trained = await real_train(state, groups, **options)
            await app.live.wait_for(app.store.last_position)
            assert app.runner is not None
            versions.append((app.live.state.policy_version, app.runner.observation().policy_version))
            return trained

        app.training.train = train  # type: ignore[method-assign]

        assert await app.run() == "reached step 3"
        assert app.engine.policy_version == 3
        assert not slept and not app.engine.is_sleeping
        # Between a step's events and the end of its push, admissions go by the version served.
        assert versions == [(1, 0), (2, 1), (3, 2)]

        stored = await app.store.read()
        events = [s.event for s in stored]
        steps = [s for s in stored if isinstance(s.event, TrainStepCompleted)]
        assert [s.event.step for s in steps if isinstance(s.event, TrainStepCompleted)] == [1, 2, 3]

        # Admitted and served while the first step was under way.
        (start,) = first_step
        during = [s for s in stored if start < s.position < steps[0].position]
        assert any(isinstance(s.event, RolloutCreated) for s in during)
        assert any(isinstance(s.event, LLMCallCompleted) for s in during)

        # Never a switch: no sleep, no trainer moves, no wake; each step trains, then pushes.
        phases = [e.phase for e in events if isinstance(e, SwitchPhaseCompleted)]
        assert phases == ["train", "drain", "push"] * 3
        assert "train" not in {e.phase for e in events if isinstance(e, PhaseChanged)}

        # Staleness stays bounded: every sampled token of a trained rollout was sampled at most
        # eta versions before the weights its step updated (step - 1), and none after them.
        calls: dict[str, list[LLMCallCompleted]] = {}
        for event in events:
            if isinstance(event, LLMCallCompleted):
                calls.setdefault(event.rollout, []).append(event)
        staleness: set[int] = set()
        for s in steps:
            assert isinstance(s.event, TrainStepCompleted)
            assert s.event.metrics["stale_tokens"] == 0
            for rollout in s.event.rollouts:
                for call in calls.get(rollout, []):
                    staleness.update(s.event.step - 1 - v for v in call.response_versions)
        assert staleness and min(staleness) >= 0 and max(staleness) <= eta
        assert max(staleness) > 0  # off-policy tokens: rollouts ran beside a step


async def test_split_step_that_fails_is_tried_again_and_a_failed_push_restarts_the_engine(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(
        tmp_path, tiny_model_dir, placement="split", mode="async", max_steps=2, batch_groups=1
    )
    async with Appliance(config) as app:
        real_train, real_push = app.training.train, app.training.push
        failures: list[str] = []

        async def train(state: RunState, groups: Sequence[str], **options: Any) -> TrainedStep:
            if not failures:
                failures.append("train")
                raise RuntimeError("the trainer fell over")
            return await real_train(state, groups, **options)

        async def push(version: int) -> None:
            if failures == ["train"]:
                failures.append("push")
                raise RuntimeError("the push fell over")
            await real_push(version)

        app.training.train = train  # type: ignore[method-assign]
        app.training.push = push  # type: ignore[method-assign]
        assert await app.run() == "reached step 2"
        assert failures == ["train", "push"]
        events = [s.event for s in await app.store.read()]
        assert [e.step for e in events if isinstance(e, TrainStepFailed)] == [1]
        # The failed push left the engine to be restarted, which pushed version 1; step 2 its own.
        assert app.engine.policy_version == 2
        assert not app.engine.is_sleeping
