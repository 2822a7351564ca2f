"""The appliance with verl's trainer over rank processes (gloo): steps, bucketed pushes that leave
the engine's weights bit-identical to the trainer's, a rank killed between steps (one failed
step, the ranks restarted from the published version, the run goes on), and a run resumed from
its sharded checkpoints with another number of ranks."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from appliance.app import Appliance
from appliance.engines.lora import served_adapter
from harness_adapters.python import PythonAdapter
from store.events import ApplianceStarted, TrainStepCompleted, TrainStepFailed
from store.eventstore import EventStore
from tests.appliance.test_checkpointing import varied_agent
from tests.support import local_engine, make_config
from trainer.ranks import RankedTrainer


def assert_engine_serves_the_trainer(app: Appliance) -> None:
    trainer = app.training.trainer
    engine: Any = local_engine(app)
    served = engine._model.state_dict()
    pushed = trainer.state_dict_for_engine()
    assert served.keys() == pushed.keys()
    for name, tensor in pushed.items():
        assert torch.equal(served[name], tensor), name


async def test_two_ranks_train_push_and_survive_a_killed_rank(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(
        tmp_path, tiny_model_dir, trainer="verl", trainer_ranks=2, max_steps=2, push_bucket_mb=1
    )
    async with Appliance(config) as app:
        trainer = app.training.trainer
        assert isinstance(trainer, RankedTrainer) and trainer.ranks == 2
        real_step = trainer.step
        killed: list[int] = []

        def step_losing_a_rank(items: Any) -> Any:
            # The second step loses rank 1 once it has begun: rank 0 is left waiting for it in
            # the step's first collective.
            if trainer.global_step == 1 and not killed:
                killed.append(trainer.group.pids()[1])
                threading.Timer(0.05, os.kill, (killed[0], signal.SIGKILL)).start()
            return real_step(items)

        trainer.step = step_losing_a_rank  # type: ignore[method-assign]
        assert await app.run() == "reached step 2"
        assert app.engine.policy_version == 2
        assert killed and killed[0] not in trainer.group.pids()  # restarted
        assert_engine_serves_the_trainer(app)

        # A rank that dies during a push: the ranks restart at the published version and the
        # push is made again.
        before = trainer.group.pids()
        os.kill(before[0], signal.SIGKILL)
        await app.training.push(app.live.state.policy_version)
        assert not set(before) & set(trainer.group.pids())
        assert_engine_serves_the_trainer(app)
        events = [s.event for s in await app.store.read()]

    (started,) = [e for e in events if isinstance(e, ApplianceStarted)]
    assert started.trainer_ranks == 2
    failed = [e for e in events if isinstance(e, TrainStepFailed)]
    assert [f.step for f in failed] == [2]
    assert "trainer rank 1 died" in failed[0].error
    assert [e.step for e in events if isinstance(e, TrainStepCompleted)] == [1, 2]
    for step in (e for e in events if isinstance(e, TrainStepCompleted)):
        assert step.metrics["trainer_ranks_rss_gib"] > 0.05  # two ranks, each holding the model


async def test_a_run_resumes_with_another_number_of_ranks(tmp_path: Path, tiny_model_dir: Path) -> None:
    """2 ranks -> 1 -> 2 over three starts of one run: each start trains on from the sharded
    checkpoint of the last (weights equal to what the previous start ended with)."""
    ended: dict[str, torch.Tensor] | None = None
    for ranks, target in ((2, 1), (1, 2), (2, 3)):
        config = make_config(tmp_path, tiny_model_dir, trainer="verl", trainer_ranks=ranks, max_steps=target)
        async with Appliance(config) as app:
            trainer = app.training.trainer
            assert isinstance(trainer, RankedTrainer) and trainer.ranks == ranks
            if ended is not None:
                restored = trainer.state_dict_for_engine()
                assert restored.keys() == ended.keys()
                assert all(torch.equal(restored[k], ended[k]) for k in ended)
                assert_engine_serves_the_trainer(app)
            assert await app.run() == f"reached step {target}"
            assert_engine_serves_the_trainer(app)
            ended = trainer.state_dict_for_engine()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert any(p.is_dir() and (p / "manifest.json").is_file() for p in checkpoints.iterdir())
    events = [s.event for s in await read_events(tmp_path / "run")]
    assert [e.trainer_ranks for e in events if isinstance(e, ApplianceStarted)] == [2, 1, 2]
    assert [e.step for e in events if isinstance(e, TrainStepCompleted)] == [1, 2, 3]


async def read_events(run_dir: Path) -> list[Any]:
    store = await EventStore.open(run_dir / "events.sqlite")
    try:
        return list(await store.read())
    finally:
        await store.close()


async def test_a_lora_run_pushes_adapters_the_engine_serves_on_its_base(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """With LoRA every push carries the adapters alone: after two steps over two ranks the engine
    still holds the model directory's weights, and with its adapters computes the trainer's
    merged weights."""
    config = make_config(
        tmp_path,
        tiny_model_dir,
        trainer="verl",
        trainer_ranks=2,
        max_steps=2,
        lora_rank=4,
        lora_alpha=8,
        lr=1e-2,
    )
    # Rewards that differ within each group: every step has advantages, so the adapters move.
    async with Appliance(config, adapter=PythonAdapter(varied_agent)) as app:
        assert await app.run() == "reached step 2"
        engine: Any = local_engine(app)
        served = engine._model.state_dict()
        adapters = served_adapter(engine._model)
        merged = app.training.trainer.state_dict_for_engine()
    base: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for name, tensor in base.state_dict().items():
        assert torch.equal(served[name], tensor), name
    assert len(adapters) == 28
    for module in {name.removesuffix(".lora_A.weight") for name in adapters if "lora_A" in name}:
        a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
        weight = served[f"{module}.weight"] + (8 / 4) * b @ a
        torch.testing.assert_close(weight, merged[f"{module}.weight"], rtol=0, atol=1e-6)
    assert any(not torch.equal(merged[name], tensor) for name, tensor in base.state_dict().items())
