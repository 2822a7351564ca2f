"""WeightsStore: per-version weights without optimizer moments, restored under the optimizer
state of a full checkpoint, for both trainer backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import sample
from trainer.checkpoints import CheckpointStore, WeightsStore, read_checkpoint
from trainer.items import Trainer, TrainItem
from trainer.policy import PolicyTrainer
from trainer.verl_backend import VerlFSDPTrainer

GOOD = [10, 11, 12]


@pytest.fixture
def hf_model(tiny_model_dir: Path) -> Iterator[Any]:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    yield model.eval()


BACKENDS: dict[str, Callable[[Path], Trainer]] = {
    "torch": lambda model_dir: PolicyTrainer(model_dir, lr=1e-2),
    "verl": lambda model_dir: VerlFSDPTrainer(model_dir, lr=1e-2),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_weights_then_full_optimizer_state_resume(
    backend: str, tiny_model_dir: Path, hf_model: Any, tmp_path: Path
) -> None:
    full = CheckpointStore(tmp_path / "checkpoints")
    weights = WeightsStore(tmp_path / "checkpoints" / "weights")
    make = BACKENDS[backend]
    trainer = make(tiny_model_dir)
    item = TrainItem("A", 1.0, (sample(hf_model, "A", GOOD),))
    trainer.step([item])
    trainer.save(full, 1)  # full checkpoint at version 1
    trainer.step([item])
    trainer.global_step = 2
    path = trainer.save(weights, 2)  # weights only at version 2
    assert path == weights.path(2)
    assert read_checkpoint(path)["optimizer"]["state"] == {}
    assert read_checkpoint(full.path(1))["optimizer"]["state"] != {}
    at_2 = trainer.state_dict_for_engine()

    # Weights of version 2 under the optimizer state of version 1.
    resumed = make(tiny_model_dir)
    assert resumed.load(WeightsStore(weights.directory, optimizer_from=full.path(1)), 2) == 2
    assert resumed.global_step == 2
    mine = resumed.state_dict_for_engine()
    assert all(torch.equal(mine[k], at_2[k]) for k in at_2)
    out = resumed.step([item])
    assert out.updated

    # No full checkpoint yet: the weights alone, with a fresh optimizer, still resume and step.
    fresh = make(tiny_model_dir)
    assert fresh.load(WeightsStore(weights.directory), 2) == 2
    assert all(torch.equal(fresh.state_dict_for_engine()[k], at_2[k]) for k in at_2)
    assert fresh.step([item]).updated


def test_discard_after_removes_unpublished_versions(tmp_path: Path) -> None:
    store = WeightsStore(tmp_path, keep=5)
    for version in (1, 2, 3):
        store.save(
            version, version, {"w": torch.ones(1)}, {"state": {0: {"m": torch.ones(1)}}, "param_groups": []}
        )
    assert store.discard_after(1) == [2, 3]
    assert store.versions() == [1]
    assert store.load(1)["optimizer"] == {"state": {}, "param_groups": []}
