"""The trainer: rollout events -> samples -> advantages -> policy-gradient steps -> checkpoints.

``trainer.samples`` and ``trainer.checkpoints`` are light; ``trainer.advantage`` and
``trainer.policy`` import verl and transformers (several seconds). So this package resolves those
names on first use: ``from trainer import Sample`` stays cheap, ``from trainer import
PolicyTrainer`` pays for the heavy imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer.checkpoints import CheckpointError, CheckpointStore, read_checkpoint, write_checkpoint
from trainer.samples import NOT_SAMPLED, Sample, build_samples, rollout_samples

if TYPE_CHECKING:
    from trainer.advantage import AdvantageResult, grpo_advantages
    from trainer.policy import LossTotals, PolicyTrainer, StepOutput, TrainItem

_LAZY = {
    "AdvantageResult": "trainer.advantage",
    "grpo_advantages": "trainer.advantage",
    "LossTotals": "trainer.policy",
    "PolicyTrainer": "trainer.policy",
    "StepOutput": "trainer.policy",
    "TrainItem": "trainer.policy",
}

__all__ = [
    "NOT_SAMPLED",
    "AdvantageResult",
    "CheckpointError",
    "CheckpointStore",
    "LossTotals",
    "PolicyTrainer",
    "Sample",
    "StepOutput",
    "TrainItem",
    "build_samples",
    "grpo_advantages",
    "read_checkpoint",
    "rollout_samples",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
