"""What a training step is given: a step's rollouts from the log -> advantages -> token samples.

Owns :func:`step_batch` (one :class:`~trainer.items.TrainItem` per trainable rollout: advantages
by the run's estimator, samples built from the recorded calls, tokens older than ``eta`` versions
counted and, with ``drop_stale``, masked out), :func:`bound_staleness`, the step's rewards
(:func:`step_rewards`, :func:`reward_std`) and token figures (:func:`token_figures`).
The training service trains on what it returns, and ``appliance.reporting.dataset_rows`` replays
it to export a step's ``tokens`` rows, so both see the same samples. It does not own how samples
are built (``trainer.samples``), the estimators (``trainer.advantage``) nor which rollouts are
trainable (``store.projections.RunState.trainable``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from store.projections import RolloutView, RunState
from trainer.advantage import AdvantageMode, compute_advantages
from trainer.items import TrainItem
from trainer.samples import Sample, build_samples

ADVANTAGE_MODES: dict[str, AdvantageMode] = {"grpo": "grpo", "rloo": "rloo", "reinforce": "reinforce"}


def step_rewards(views: Sequence[RolloutView]) -> tuple[float, ...]:
    """The rewards ``store.projections.reward_mean`` averages, in the order of ``views``."""
    return tuple(float(v.reward) for v in views if RunState.trainable(v) and v.reward is not None)


def token_figures(views: Sequence[RolloutView], trained: int) -> dict[str, float]:
    """A step's token figures (docs/metrics.md), as its metrics record them: the tokens the
    policy sampled for its rollouts and their calls' prompt tokens (every call, failed rollouts
    too), and ``trained``, the sampled tokens its loss held."""
    return {
        "tokens_sampled": float(sum(v.tokens_sampled for v in views)),
        "tokens_prompt": float(sum(v.tokens_prompt for v in views)),
        "tokens_trained": float(trained),
    }


def reward_std(views: Sequence[RolloutView]) -> float:
    """Population standard deviation of the rewards ``reward_mean`` averages (0.0: none)."""
    rewards = step_rewards(views)
    if not rewards:
        return 0.0
    mean = sum(rewards) / len(rewards)
    return float((sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5)


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


@dataclass(frozen=True, slots=True)
class StepBatch:
    """A step's training input and what the step records about its tokens' staleness."""

    #: The step's trainable rollouts (``RunState.trainable``, with calls), in the step's order.
    trainable: list[RolloutView]
    #: One per trainable rollout, in the same order.
    items: list[TrainItem]
    zero_variance_groups: int
    #: Sampled tokens more than ``eta`` versions old, and how many of them left the loss.
    stale_tokens: int
    dropped: int
    #: Per trained token: the versions between its sampling and the policy being updated.
    staleness: list[int]


def step_batch(
    views: Sequence[RolloutView], *, policy_version: int, advantage: str, eta: int | None, drop_stale: bool
) -> StepBatch:
    """The items a step from ``policy_version`` trains on, over the step's rollouts ``views``."""
    trainable = [v for v in views if RunState.trainable(v) and v.calls]
    rewards = [float(v.reward or 0.0) for v in trainable]
    credit = compute_advantages(ADVANTAGE_MODES[advantage], rewards, [v.group for v in trainable])
    dropped = 0
    stale_tokens = 0
    staleness: list[int] = []
    items: list[TrainItem] = []
    for view, value in zip(trainable, credit.advantages, strict=True):
        samples = []
        for sample in build_samples(view.calls):
            bounded, stale = bound_staleness(sample, policy_version, eta)
            stale_tokens += stale
            if drop_stale:
                sample = bounded
                dropped += stale
            staleness.extend(
                policy_version - v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m
            )
            samples.append(sample)
        items.append(
            TrainItem(rollout=view.rollout, advantage=value, samples=tuple(samples), reward=view.reward)
        )
    return StepBatch(
        trainable=trainable,
        items=items,
        zero_variance_groups=credit.zero_variance_groups,
        stale_tokens=stale_tokens,
        dropped=dropped,
        staleness=staleness,
    )
