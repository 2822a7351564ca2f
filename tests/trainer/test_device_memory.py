"""Every trainer backend's offload ends by handing the GPU's cached memory back.

No GPU here: ``torch.cuda``'s ``is_available``, ``synchronize`` and ``empty_cache`` are replaced
by recorders, the trainers are built on the CPU and then told their device is ``cuda:0``, and the
moves of their state to host memory are recorded too. What is asserted is the order: the cache
is emptied after the last move (the optimizer state's), and after a synchronize. verl 0.9.1's
``FSDPEngine.to("cpu")`` empties the cache before it moves the optimizer state, so an offload
that stopped there kept Adam's moments reserved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import sample
from trainer.device_memory import release_cached
from trainer.items import TrainItem
from trainer.policy import PolicyTrainer
from trainer.verl_backend import VerlFSDPTrainer

CUDA = torch.device("cuda", 0)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What reached ``torch.cuda``, in order (a CUDA machine, as far as the callers can tell)."""
    seen: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(f"synchronize {device}"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    return seen


def trained_items(model_dir: Path) -> list[TrainItem]:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    return [TrainItem("A", 1.0, (sample(model.eval(), "A", [10, 11, 12]),))]


def test_release_waits_then_empties_on_cuda_only(calls: list[str]) -> None:
    release_cached(torch.device("cpu"))
    assert calls == []
    release_cached(CUDA)
    assert calls == ["synchronize cuda:0", "empty_cache"]


def test_the_verl_backend_empties_the_cache_after_the_optimizer_state_moved(
    tiny_model_dir: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=1e-2)
    trainer.step(trained_items(tiny_model_dir))  # Adam's moments exist from here on
    real_to = trainer.engine.to

    def to(device: str, **parts: bool) -> None:
        real_to(device, **parts)
        calls.append(f"to {device} optimizer={parts.get('optimizer')}")

    monkeypatch.setattr(trainer.engine, "to", to)
    monkeypatch.setattr(trainer, "device", CUDA)
    trainer.offload()
    assert calls == ["to cpu optimizer=True", "synchronize cuda:0", "empty_cache"]


def test_the_torch_backend_empties_the_cache_after_the_optimizer_state_moved(
    tiny_model_dir: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = PolicyTrainer(tiny_model_dir, lr=1e-2)
    trainer.step(trained_items(tiny_model_dir))
    moments = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments
    real_to = torch.Tensor.to

    def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if any(tensor is m for m in moments):
            calls.append("moment to cpu")
        return real_to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(trainer, "device", CUDA)
    trainer.offload()
    monkeypatch.undo()
    assert calls[-2:] == ["synchronize cuda:0", "empty_cache"]
    assert calls[:-2] == ["moment to cpu"] * len(moments)
