"""The trainer contract: what a training step takes (:class:`TrainItem`), what it reports
(:class:`StepOutput`), and the :class:`Trainer` protocol both backends implement.

Owns these light types and the checks every backend applies to its input. It does not own any
model, loss or optimizer (``trainer.policy`` is the plain-torch backend, ``trainer.verl_backend``
the verl FSDP one) nor how the per-token weights are chosen (``trainer.normalization``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from trainer.checkpoints import CheckpointStore
from trainer.samples import Overflow, Sample, truncate_sample

if TYPE_CHECKING:
    from trainer.buckets import WeightBucket
    from trainer.sharded import ShardedStore


@dataclass(frozen=True, slots=True)
class TrainItem:
    """One rollout to train on: its advantage applies to every token it sampled."""

    rollout: str
    advantage: float
    samples: tuple[Sample, ...]
    #: The rollout's reward, when known: only for the step's reward metrics.
    reward: float | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one training step did. Token metrics are plain means over the trained tokens."""

    #: The trainer's step count after this step.
    step: int
    #: False when the optimizer was not stepped: every advantage was 0, or the gradient was not
    #: finite. The weights are then unchanged.
    updated: bool
    #: The normalized policy loss (plus the KL term when there is one).
    loss: float
    #: Total gradient norm before clipping.
    grad_norm: float
    #: Fraction of tokens whose ratio was clipped.
    pg_clipfrac: float
    #: Mean of ``log pi_old - log pi_theta`` (an estimate of KL(old || policy)).
    ppo_kl: float
    #: Mean entropy of the policy's next-token distribution at the sampled positions.
    entropy: float
    tokens: int
    samples: int
    rollouts: int
    duration_s: float
    #: Mean KL estimate to the reference model (0.0 without one).
    kl_ref: float = 0.0
    #: Mean truncated importance weight ``min(pi_old / pi_sampler, cap)`` and the fraction of
    #: tokens at the cap (1.0 and 0.0 when the backend does not reweight).
    is_weight_mean: float = 1.0
    is_capped_frac: float = 0.0
    #: Samples given to the step that had been truncated (``Sample.truncation`` set).
    truncated_samples: int = 0
    #: Mean and (population) standard deviation of the items' rewards, when they were given.
    reward_mean: float | None = None
    reward_std: float | None = None

    def metrics(self) -> dict[str, float]:
        """The float metrics, as ``TrainStepCompleted.metrics`` records them."""
        out = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "pg_clipfrac": self.pg_clipfrac,
            "ppo_kl": self.ppo_kl,
            "entropy": self.entropy,
            "updated": float(self.updated),
            "kl_ref": self.kl_ref,
            "is_weight_mean": self.is_weight_mean,
            "is_capped_frac": self.is_capped_frac,
            "tokens_per_s": self.tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "samples_per_rollout": self.samples / self.rollouts if self.rollouts else 0.0,
            "truncated_samples": float(self.truncated_samples),
        }
        if self.reward_mean is not None and self.reward_std is not None:
            out["reward_mean"] = self.reward_mean
            out["reward_std"] = self.reward_std
        return out


@runtime_checkable
class Trainer(Protocol):
    """A trainable policy: the API ``appliance.training.service`` drives, whatever the backend."""

    #: Optimizer steps taken (restored by ``load``; the training service may set it).
    global_step: int

    def step(self, items: Sequence[TrainItem]) -> StepOutput:
        """One policy-gradient step over ``items`` (one or more rollouts, each at most once)."""
        ...

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the full weights, HF names, for ``Engine.load_weights``."""
        ...

    def weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """The same weights (a tied LM head left out) in buckets of about ``bucket_bytes``, for
        ``Engine.load_weight_buckets``; each bucket is valid until the next is asked for."""
        ...

    def save(self, store: CheckpointStore | ShardedStore, version: int) -> Path:
        """Write model, optimizer and step as ``version``; returns the file (or directory)."""
        ...

    def load(self, store: CheckpointStore | ShardedStore, version: int | None = None) -> int:
        """Restore model, optimizer and step from ``version`` (default: the latest)."""
        ...

    def offload(self) -> None:
        """Move parameters and optimizer state to host memory (between steps)."""
        ...

    def onload(self) -> None:
        """Bring them back to the training device."""
        ...

    def export_hf(self, directory: Path) -> Path:
        """Write the current weights as a Hugging Face model directory."""
        ...


def trainable_tokens(sample: Sample) -> int:
    """Tokens of ``sample`` a step trains: sampled ones, except position 0 (nothing predicts it)."""
    return sum(sample.loss_mask[1:])


def reward_stats(items: Sequence[TrainItem]) -> tuple[float | None, float | None]:
    """Mean and population std of the items' rewards, or (None, None) if any is unknown."""
    rewards = [it.reward for it in items]
    if not rewards or any(r is None for r in rewards):
        return None, None
    values = [float(r) for r in rewards if r is not None]
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in values) / len(values))


def check_items(items: Sequence[TrainItem]) -> None:
    """Raise ``ValueError`` unless ``items`` is a valid step: non-empty, each rollout once, finite
    advantages, and every sample belonging to its item's rollout."""
    if not items:
        raise ValueError("a training step needs at least one rollout")
    seen: set[str] = set()
    for item in items:
        if item.rollout in seen:
            raise ValueError(f"rollout {item.rollout!r} appears twice in one step")
        seen.add(item.rollout)
        if not math.isfinite(item.advantage):
            raise ValueError(f"rollout {item.rollout!r} has a non-finite advantage {item.advantage}")
        for sample in item.samples:
            if sample.rollout != item.rollout:
                raise ValueError(f"a sample of rollout {sample.rollout!r} was given as {item.rollout!r}")


def truncate_items(items: Sequence[TrainItem], max_tokens: int | None, overflow: Overflow) -> list[TrainItem]:
    """``items`` with every sample longer than ``max_tokens`` truncated (``truncate_sample``);
    unchanged when ``max_tokens`` is None."""
    if max_tokens is None:
        return list(items)
    return [
        TrainItem(
            it.rollout,
            it.advantage,
            tuple(truncate_sample(s, max_tokens, overflow) for s in it.samples),
            it.reward,
        )
        for it in items
    ]


def has_signal(items: Sequence[TrainItem]) -> bool:
    """Whether any rollout with a non-zero advantage has a token to train: if not, the gradient
    is exactly zero and an optimizer step would only apply stale momentum."""
    return any(it.advantage != 0.0 and any(trainable_tokens(s) > 0 for s in it.samples) for it in items)
