"""make_trainer: a backend by name, with the API the training service drives."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.factory import make_trainer
from trainer.items import Trainer
from trainer.policy import PolicyTrainer
from trainer.verl_backend import VerlFSDPTrainer


def test_each_backend_by_name(tiny_model_dir: Path) -> None:
    torch_trainer = make_trainer(
        "torch", tiny_model_dir, lr=1e-3, grad_clip=1.0, device="cpu", temperature=1.0
    )
    assert isinstance(torch_trainer, PolicyTrainer) and isinstance(torch_trainer, Trainer)
    verl_trainer = make_trainer("verl", tiny_model_dir, lr=1e-3, grad_clip=1.0, device="cpu", kl_coef=0.0)
    assert isinstance(verl_trainer, VerlFSDPTrainer) and isinstance(verl_trainer, Trainer)
    assert verl_trainer.off_policy == "decoupled" and torch_trainer.off_policy == "bypass"


def test_unknown_backends_and_misplaced_options(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown trainer backend 'jax'; use one of torch, verl"):
        make_trainer("jax", tiny_model_dir)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"options \['kl_coef', 'lora_rank'\] need backend='verl'"):
        make_trainer("torch", tiny_model_dir, kl_coef=0.1, lora_rank=8)
