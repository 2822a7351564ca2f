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
from dataclasses import dataclass, replace

from appliance.engines.base import Engine
from store.events import Event, PolicyVersionPublished, TrainStepCompleted
from store.eventstore import EventStore
from store.projections import RolloutView, RunState
from trainer.advantage import AdvantageMode, compute_advantages
from trainer.checkpoints import CheckpointStore
from trainer.items import Trainer, TrainItem
from trainer.samples import Sample, build_samples

ADVANTAGE_MODES: dict[str, AdvantageMode] = {"grpo": "grpo", "rloo": "rloo", "reinforce": "reinforce"}


class TrainingService:
    def __init__(
        self,
        *,
        trainer: Trainer,
        checkpoints: CheckpointStore,
        store: EventStore,
        engine: Engine,
        advantage: str = "grpo",
    ) -> None:
        self.trainer = trainer
        self.advantage = advantage
        self.checkpoints = checkpoints
        self.store = store
        self.engine = engine

    async def restore(self, version: int) -> int:
        """Load the trainer and the engine at ``version`` from its checkpoint; returns its step."""
        await asyncio.to_thread(self.trainer.load, self.checkpoints, version)
        await self.engine.load_weights(self.trainer.state_dict_for_engine(), version)
        return self.trainer.global_step

    async def train(
        self, state: RunState, groups: Sequence[str], *, eta: int | None = None, drop_stale: bool = True
    ) -> TrainedStep:
        """One gradient step on ``groups``; durable (checkpoint, then events) when it returns.

        With ``eta``, tokens sampled more than ``eta`` versions before the policy being updated
        are counted, and dropped from the loss when ``drop_stale`` (otherwise they stay, and the
        trainer's off-policy correction weighs them: the clipped ratio to their stored sampling
        log-probs for the torch backend, truncated importance weights for verl).
        """
        started = time.perf_counter()
        wanted = set(groups)
        views: list[RolloutView] = [v for v in state.rollouts.values() if v.group in wanted]
        trainable = [v for v in views if RunState.trainable(v) and v.calls]
        rewards = [float(v.reward or 0.0) for v in trainable]
        credit = compute_advantages(ADVANTAGE_MODES[self.advantage], rewards, [v.group for v in trainable])
        dropped = 0
        stale_tokens = 0
        staleness: list[int] = []
        items: list[TrainItem] = []
        for view, advantage in zip(trainable, credit.advantages, strict=True):
            samples = []
            for sample in build_samples(view.calls):
                bounded, stale = bound_staleness(sample, state.policy_version, eta)
                stale_tokens += stale
                if drop_stale:
                    sample = bounded
                    dropped += stale
                staleness.extend(
                    state.policy_version - v
                    for v, m in zip(sample.versions, sample.loss_mask, strict=True)
                    if m
                )
                samples.append(sample)
            items.append(
                TrainItem(
                    rollout=view.rollout, advantage=advantage, samples=tuple(samples), reward=view.reward
                )
            )
        step = state.step + 1
        metrics: dict[str, float] = {}
        events: list[Event] = []
        version: int | None = None
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
        metrics["stale_tokens"] = float(stale_tokens)
        metrics["stale_tokens_dropped"] = float(dropped)
        metrics["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
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
        return TrainedStep(completed=completed, version=version)

    async def push(self, version: int) -> None:
        """Load the trainer's current weights into the engine as ``version``."""
        await self.engine.load_weights(self.trainer.state_dict_for_engine(), version)

    async def step(
        self, state: RunState, groups: Sequence[str], *, eta: int | None = None
    ) -> TrainStepCompleted:
        """``train`` then ``push``: the whole step when nothing needs to happen in between."""
        trained = await self.train(state, groups, eta=eta)
        if trained.version is not None:
            await self.push(trained.version)
        return trained.completed


@dataclass(frozen=True, slots=True)
class TrainedStep:
    completed: TrainStepCompleted
    #: The policy version the step produced (None: nothing was trainable).
    version: int | None


def bound_staleness(sample: Sample, current_version: int, eta: int | None) -> tuple[Sample, int]:
    """Mask out sampled tokens more than ``eta`` versions older than ``current_version``."""
    if eta is None:
        return sample, 0
    mask = list(sample.loss_mask)
    dropped = 0
    for i, (m, v) in enumerate(zip(sample.loss_mask, sample.versions, strict=True)):
        if m and current_version - v > eta:
            mask[i] = 0
            dropped += 1
    if not dropped:
        return sample, 0
    return replace(sample, loss_mask=tuple(mask)), dropped
