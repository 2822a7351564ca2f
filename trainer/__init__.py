"""The trainer: rollout events -> samples -> advantages -> policy-gradient steps -> checkpoints.

``trainer.samples``, ``trainer.items``, ``trainer.normalization``, ``trainer.factory`` and
``trainer.checkpoints`` are light; the advantage estimators, the loss options and both backends
(``trainer.policy``: plain torch; ``trainer.verl_backend``: verl's FSDP engine) import verl and
transformers (several seconds). So this package resolves those names on first use:
``from trainer import Sample`` stays cheap, ``from trainer import PolicyTrainer`` pays for the
heavy imports.

May import: ``store`` (the recorded calls samples are built from) and ``contracts`` (the error
base), nothing else of the project: the appliance drives the trainer (``appliance.training``),
never the other way, and the weight-bucket format both sides read lives here
(``trainer.buckets``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer.checkpoints import CheckpointError, CheckpointStore, read_checkpoint, write_checkpoint
from trainer.factory import BACKENDS, make_trainer
from trainer.items import StepOutput, Trainer, TrainItem
from trainer.normalization import NORMALIZATIONS, sample_weights
from trainer.samples import NOT_SAMPLED, Sample, build_samples, rollout_samples, truncate_sample

if TYPE_CHECKING:
    from trainer.advantage import (
        AdvantageResult,
        compute_advantages,
        grpo_advantages,
        reinforce_advantages,
        rloo_advantages,
    )
    from trainer.policy import PolicyTrainer
    from trainer.step_plan import LossTotals
    from trainer.verl_backend import VerlFSDPTrainer

_LAZY = {
    "AdvantageResult": "trainer.advantage",
    "compute_advantages": "trainer.advantage",
    "grpo_advantages": "trainer.advantage",
    "reinforce_advantages": "trainer.advantage",
    "rloo_advantages": "trainer.advantage",
    "LossTotals": "trainer.step_plan",
    "PolicyTrainer": "trainer.policy",
    "VerlFSDPTrainer": "trainer.verl_backend",
}

__all__ = [
    "BACKENDS",
    "NORMALIZATIONS",
    "NOT_SAMPLED",
    "AdvantageResult",
    "CheckpointError",
    "CheckpointStore",
    "LossTotals",
    "PolicyTrainer",
    "Sample",
    "StepOutput",
    "TrainItem",
    "Trainer",
    "VerlFSDPTrainer",
    "build_samples",
    "compute_advantages",
    "grpo_advantages",
    "make_trainer",
    "read_checkpoint",
    "reinforce_advantages",
    "rloo_advantages",
    "rollout_samples",
    "sample_weights",
    "truncate_sample",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
