"""TrainingService with the verl backend: restore from sharded checkpoints, and from the single
``.pt`` files of a run written before checkpoints were sharded; the push in bf16."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from appliance.engines.lora import served_adapter
from appliance.engines.torch_engine import TorchEngine
from appliance.training.service import TrainingService
from store.eventstore import EventStore
from store.projections import RunState
from tests.trainer.helpers import sample
from trainer.checkpoints import WeightsStore
from trainer.items import TrainItem
from trainer.sharded import ShardedStore, ShardedWeightsStore
from trainer.verl_backend import VerlFSDPTrainer


def trained(model_dir: Path, **options: Any) -> VerlFSDPTrainer:
    """A verl trainer one step away from the model's own weights."""
    trainer = VerlFSDPTrainer(model_dir, lr=1e-2, **options)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    trainer.step(
        [
            TrainItem("a", 1.0, (sample(model, "a", [10, 11, 12]),)),
            TrainItem("b", -1.0, (sample(model, "b", [20, 21]),)),
        ]
    )
    return trainer


async def restored(
    model_dir: Path, run: Path, state: RunState, push_dtype: torch.dtype | None = None, **options: Any
) -> tuple[VerlFSDPTrainer, dict[str, Any]]:
    """A fresh trainer and engine restored by the service to ``state``; the engine's weights
    (with the adapter it serves, if any, under the push's names)."""
    trainer = VerlFSDPTrainer(model_dir, lr=1e-2, **options)
    engine = TorchEngine(model_dir)
    await engine.start()
    store = await EventStore.open(run / "events.sqlite")
    try:
        service = TrainingService(
            trainer=trainer,
            checkpoints=ShardedStore(run / "checkpoints"),
            store=store,
            engine=engine,
            push_bucket_bytes=4096,
            push_dtype=push_dtype,
        )
        assert await service.restore(state) == state.step
        assert engine.policy_version == state.policy_version
        served = {k: v.clone() for k, v in engine._model.state_dict().items()}
        served |= {k: v.clone() for k, v in served_adapter(engine._model).items()}
    finally:
        await store.close()
        await engine.close()
    return trainer, served


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


async def test_restores_a_sharded_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    source = trained(tiny_model_dir)
    source.global_step = 1
    path = source.save(ShardedWeightsStore(tmp_path / "checkpoints" / "weights"), 1)
    state = RunState(policy_version=1, step=1, checkpoint=str(path.relative_to(tmp_path)))

    trainer, served = await restored(tiny_model_dir, tmp_path, state)

    expected = source.state_dict_for_engine()
    assert trainer.global_step == 1
    assert_equal(trainer.state_dict_for_engine(), expected)
    assert_equal(served, expected)


async def test_resumes_a_run_whose_checkpoints_are_single_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    source = trained(tiny_model_dir)
    source.global_step = 1
    path = source.save(WeightsStore(tmp_path / "checkpoints" / "weights"), 1)
    assert path.name == "v000001.pt"
    state = RunState(policy_version=1, step=1, checkpoint=str(path.relative_to(tmp_path)))

    trainer, served = await restored(tiny_model_dir, tmp_path, state)

    expected = source.state_dict_for_engine()
    assert_equal(trainer.state_dict_for_engine(), expected)
    assert_equal(served, expected)


async def test_pushes_in_bf16_when_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A trainer computing in bf16 hands the engine bf16 weights: the engine (fp32 here) serves
    the master weights rounded to bf16."""
    source = trained(tiny_model_dir)
    source.global_step = 1
    path = source.save(ShardedWeightsStore(tmp_path / "checkpoints" / "weights"), 1)
    state = RunState(policy_version=1, step=1, checkpoint=str(path.relative_to(tmp_path)))

    _, served = await restored(tiny_model_dir, tmp_path, state, push_dtype=torch.bfloat16)

    expected = source.state_dict_for_engine()
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in expected.values())
    assert_equal(served, {k: v.to(torch.bfloat16).float() for k, v in expected.items()})


async def test_a_lora_run_is_restored_as_base_weights_and_adapters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A LoRA version is checkpointed as its adapters and pushed as its adapters: the engine
    serves the model directory's weights with the trainer's adapters on top."""
    options: dict[str, Any] = {"lora_rank": 4, "lora_alpha": 8}
    source = trained(tiny_model_dir, **options)
    source.global_step = 1
    path = source.save(ShardedWeightsStore(tmp_path / "checkpoints" / "weights"), 1)
    state = RunState(policy_version=1, step=1, checkpoint=str(path.relative_to(tmp_path)))

    trainer, served = await restored(tiny_model_dir, tmp_path, state, **options)

    base: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapters = dict(source._adapter_tensors())
    assert len(adapters) == 28 and any(t.abs().max() > 0 for n, t in adapters.items() if "lora_B" in n)
    assert_equal(served, dict(base.state_dict()) | adapters)
    assert_equal(trainer.state_dict_for_engine(), source.state_dict_for_engine())
