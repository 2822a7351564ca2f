"""One training step of the running appliance: events in, new policy version out.

Owns the glue between the trainer package, the store and the engine. For a batch of finished
rollout groups it builds token-exact samples from the recorded call events, computes GRPO
advantages per group, takes one policy-gradient step (in a worker thread), writes a checkpoint,
makes ``TrainStepCompleted`` + ``PolicyVersionPublished`` durable in one append, and only then
pushes the weights into the engine. A batch with nothing trainable (every rollout failed) is
still consumed by a step, but publishes no new version.

Order matters for crash safety: checkpoint on disk -> events durable -> engine updated. A crash
before the append leaves the old version current (its checkpoint is still kept); a crash after
it resumes from the new checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from appliance.engines.base import Engine
from store.events import Event, PolicyVersionPublished, TrainStepCompleted
from store.eventstore import EventStore
from store.projections import RolloutView, RunState
from trainer.advantage import grpo_advantages
from trainer.checkpoints import CheckpointStore
from trainer.policy import PolicyTrainer, TrainItem
from trainer.samples import build_samples


class TrainingService:
    def __init__(
        self, *, trainer: PolicyTrainer, checkpoints: CheckpointStore, store: EventStore, engine: Engine
    ) -> None:
        self.trainer = trainer
        self.checkpoints = checkpoints
        self.store = store
        self.engine = engine

    async def restore(self, version: int) -> int:
        """Load the trainer and the engine at ``version`` from its checkpoint; returns its step."""
        await asyncio.to_thread(self.trainer.load, self.checkpoints, version)
        await self.engine.load_weights(self.trainer.state_dict_for_engine(), version)
        return self.trainer.global_step

    async def step(self, state: RunState, groups: Sequence[str]) -> TrainStepCompleted:
        started = time.perf_counter()
        wanted = set(groups)
        views: list[RolloutView] = [v for v in state.rollouts.values() if v.group in wanted]
        trainable = [v for v in views if RunState.trainable(v) and v.calls]
        rewards = [float(v.reward or 0.0) for v in trainable]
        credit = grpo_advantages(rewards, [v.group for v in trainable])
        items = [
            TrainItem(rollout=v.rollout, advantage=adv, samples=tuple(build_samples(v.calls)))
            for v, adv in zip(trainable, credit.advantages, strict=True)
        ]
        step = state.step + 1
        metrics: dict[str, float] = {}
        events: list[Event] = []
        if items:
            output = await asyncio.to_thread(self.trainer.step, items)
            metrics.update(output.metrics())
            version = state.policy_version + 1
            self.trainer.global_step = step
            path = await asyncio.to_thread(self.trainer.save, self.checkpoints, version)
            published = PolicyVersionPublished(
                ts=time.time(),
                policy_version=version,
                step=step,
                checkpoint=str(path.relative_to(self.checkpoints.directory.parent)),
            )
            events.append(published)
        metrics["reward_mean"] = sum(rewards) / len(rewards) if rewards else 0.0
        metrics["rollouts_failed"] = float(sum(1 for v in views if v.status == "failed"))
        completed = TrainStepCompleted(
            ts=time.time(),
            step=step,
            rollouts=tuple(v.rollout for v in views),
            samples=sum(len(i.samples) for i in items),
            tokens=sum(len(s.tokens) for i in items for s in i.samples),
            zero_variance_groups=credit.zero_variance_groups,
            metrics=metrics,
            duration_s=time.perf_counter() - started,
        )
        # One append: the step and the version it produced become durable together.
        await self.store.append([completed, *events])
        if items:
            await self.engine.load_weights(self.trainer.state_dict_for_engine(), state.policy_version + 1)
        return completed
