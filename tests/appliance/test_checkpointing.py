"""Checkpoints of a real appliance: weights every step, full checkpoints every N steps and at
shutdown, the Hugging Face export, and resuming from weights plus the last full checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM

from appliance.app import Appliance
from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import PythonAdapter
from store.events import CheckpointSaved, Event, ModelExported, PolicyVersionPublished
from tests.support import make_config
from trainer.checkpoints import PublishedWeights, read_checkpoint
from trainer.policy import PolicyTrainer


async def varied_agent(task: Task, client: ClientConfig) -> float:
    """One call; rewards differ within a group, so every step has a gradient and Adam moments."""
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        await oai.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": task.data["question"]}], max_tokens=4
        )
    return 1.0 if client.rollout_id.endswith("-r0") else 0.0


async def events(app: Appliance) -> list[Event]:
    return [s.event for s in await app.store.read()]


def trainer_of(app: Appliance) -> PolicyTrainer:
    trainer = app.training.trainer
    assert isinstance(trainer, PolicyTrainer)
    return trainer


def assert_same_tensors(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


async def test_weights_every_step_full_checkpoint_every_n_and_export_at_shutdown(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=3, batch_groups=1, checkpoint_every=2)
    run_dir = config.data_dir
    async with Appliance(config, adapter=PythonAdapter(varied_agent)) as app:
        assert await app.run() == "reached step 3"
        log = await events(app)
        final = trainer_of(app).state_dict_for_engine()

    published = {e.policy_version: e.checkpoint for e in log if isinstance(e, PolicyVersionPublished)}
    assert published == {
        1: "checkpoints/weights/v000001.pt",
        2: "checkpoints/v000002.pt",
        3: "checkpoints/weights/v000003.pt",
    }
    saved = [(e.reason, e.step, e.policy_version, e.path) for e in log if isinstance(e, CheckpointSaved)]
    assert saved == [
        ("periodic", 2, 2, "checkpoints/v000002.pt"),
        ("shutdown", 3, 3, "checkpoints/v000003.pt"),
    ]
    # Weight files leave the optimizer's moments out; full checkpoints keep them.
    assert read_checkpoint(run_dir / published[3])["optimizer"]["state"] == {}
    assert read_checkpoint(run_dir / "checkpoints/v000003.pt")["optimizer"]["state"] != {}
    assert read_checkpoint(run_dir / "checkpoints/v000003.pt")["step"] == 3
    # Kept by default: the latest full checkpoint, the fp32 weights of the version the log
    # names last, and bf16 copies of the latest 2 published versions.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("v*.pt")) == ["v000003.pt"]
    assert sorted(p.name for p in (run_dir / "checkpoints/weights").iterdir()) == ["v000003.pt"]
    assert sorted(p.name for p in (run_dir / "checkpoints/published").iterdir()) == [
        "v000002.safetensors",
        "v000003.safetensors",
    ]
    bf16 = PublishedWeights(run_dir / "checkpoints/published").load(3)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    for name, tensor in bf16.items():
        assert torch.equal(tensor, final[name].to(torch.bfloat16)), name

    (exported,) = [e for e in log if isinstance(e, ModelExported)]
    assert (exported.step, exported.policy_version) == (3, 3)
    model = AutoModelForCausalLM.from_pretrained(exported.path, dtype=torch.float32)
    assert_same_tensors(dict(model.state_dict()), final)
    assert (Path(exported.path) / "tokenizer.json").is_file() or (
        Path(exported.path) / "vocab.json"
    ).is_file()


async def test_restart_loads_the_published_weights_and_the_last_full_optimizer_state(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=3, batch_groups=1, checkpoint_every=2)
    run_dir = config.data_dir
    async with Appliance(config, adapter=PythonAdapter(varied_agent)) as app:
        # The scheduler alone: three steps, then the process "dies" (no shutdown checkpoint).
        assert app.runner is not None
        await app.runner.run()
        weights_at_3 = trainer_of(app).state_dict_for_engine()
        assert not any(isinstance(e, CheckpointSaved) and e.reason == "shutdown" for e in await events(app))
    # A step that died after writing its files but before its events: never published.
    for leftover in (run_dir / "checkpoints/weights/v000004.pt", run_dir / "checkpoints/v000004.pt"):
        leftover.write_bytes((run_dir / "checkpoints/v000002.pt").read_bytes())

    async with Appliance(config, adapter=PythonAdapter(varied_agent)) as again:
        trainer = trainer_of(again)
        assert again.engine.policy_version == 3
        assert trainer.global_step == 3
        assert_same_tensors(trainer.state_dict_for_engine(), weights_at_3)
        moments = read_checkpoint(run_dir / "checkpoints/v000002.pt")["optimizer"]["state"]
        restored = trainer.optimizer.state_dict()["state"]
        assert restored.keys() == moments.keys() and moments
        for index, state in moments.items():
            assert torch.equal(restored[index]["exp_avg"], state["exp_avg"])
        assert not (run_dir / "checkpoints/weights/v000004.pt").exists()
        assert not (run_dir / "checkpoints/v000004.pt").exists()
