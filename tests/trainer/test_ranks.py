"""Trainer ranks: verl's FSDP engine over N worker processes on gloo, driven as one trainer.

The step at 2 ranks is the step at 1 rank (same loss, same updated weights, fp32); a rank that
dies mid-step fails the step with ``TrainerRankFailed`` without hanging, and a restarted group
trains on.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import sample
from trainer.buckets import bucket_tensors
from trainer.checkpoints import CheckpointStore, buckets_to_hf, export_hf_model
from trainer.items import TrainItem
from trainer.rank_rpc import TrainerRankFailed
from trainer.ranks import RankedTrainer, RankGroup, rank_options
from trainer.sharded import ShardedStore
from trainer.verl_backend import VerlFSDPTrainer

LR = 1e-2


def batch(model: Any) -> list[TrainItem]:
    """Five rollouts of different lengths (one with two samples), mixed advantages."""
    return [
        TrainItem("A", 1.0, (sample(model, "A", [10, 11, 12, 13, 14, 15]),), reward=1.0),
        TrainItem("B", -1.0, (sample(model, "B", [20, 21]),), reward=0.0),
        TrainItem(
            "C", 0.5, (sample(model, "C", [30, 31, 32]), sample(model, "C", [33, 34, 35, 36])), reward=0.7
        ),
        TrainItem("D", -0.5, (sample(model, "D", [40]),), reward=0.2),
        TrainItem("E", 0.0, (sample(model, "E", [50, 51, 52, 53]),), reward=0.5),
    ]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return model.eval()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir: Path) -> Iterator[RankedTrainer]:
    trainer = RankedTrainer(tiny_model_dir, ranks=2, threads=1, lr=LR, kl_coef=0.1, mini_batches=2)
    yield trainer
    trainer.close()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal up to summation order. AdamW moves every weight by about ``LR`` whatever the size of
    its gradient, so a gradient element near zero turns float rounding into a visible step: the
    bound is 0.5% of a step (a missing or doubled rank's gradient is off by whole steps). The
    keys' biases are left out: their gradient is zero in exact arithmetic (a constant added to
    every key of a query leaves its softmax unchanged), so Adam's step there is rounding noise
    of either sign."""
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("k_proj.bias"):
            continue
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=5e-3 * LR, msg=name)


def test_two_ranks_take_the_same_step_as_one(
    two_ranks: RankedTrainer, tiny_model_dir: Path, hf_model: Any
) -> None:
    one = VerlFSDPTrainer(tiny_model_dir, lr=LR, kl_coef=0.1, mini_batches=2)
    start = one.state_dict_for_engine()
    assert_same_weights(two_ranks.state_dict_for_engine(), start)
    items = batch(hf_model)

    a, b = one.step(items), two_ranks.step(items)

    assert a.updated and b.updated
    assert (b.step, b.tokens, b.samples, b.rollouts) == (a.step, a.tokens, a.samples, a.rollouts)
    for field in ("loss", "grad_norm", "entropy", "ppo_kl", "kl_ref", "is_weight_mean"):
        assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-5, abs=1e-6), field
    after = one.state_dict_for_engine()
    assert any(not torch.equal(after[k], start[k]) for k in after)  # the step moved the weights
    assert_same_weights(two_ranks.state_dict_for_engine(), after)

    # One rollout for two ranks: the second gets an inert row and adds nothing.
    single = [TrainItem("F", 1.0, (sample(hf_model, "F", [60, 61, 62]),), reward=1.0)]
    a, b = one.step(single), two_ranks.step(single)
    assert b.tokens == a.tokens == 3
    assert b.loss == pytest.approx(a.loss, abs=1e-6)
    assert_same_weights(two_ranks.state_dict_for_engine(), one.state_dict_for_engine())


def test_checkpoint_from_two_ranks_loads_into_one(
    two_ranks: RankedTrainer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    two_ranks.global_step = 7
    two_ranks.save(store, 3)
    one = VerlFSDPTrainer(tiny_model_dir, lr=LR, kl_coef=0.1, mini_batches=2)
    assert one.load(store, 3) == 3 and one.global_step == 7
    assert_same_weights(one.state_dict_for_engine(), two_ranks.state_dict_for_engine())


def test_a_rank_killed_mid_step_fails_the_step_and_a_restart_trains_on(
    tiny_model_dir: Path, hf_model: Any, tmp_path: Path
) -> None:
    trainer = RankedTrainer(tiny_model_dir, ranks=2, threads=1, lr=LR)
    try:
        store = CheckpointStore(tmp_path / "checkpoints")
        trainer.save(store, 0)
        victim = trainer.group.pids()[1]
        # A step of many long rows takes seconds; the kill lands inside it (or just before:
        # either way rank 0 is left waiting in a collective for a peer that is gone).
        items = [
            TrainItem(f"r{i}", 1.0 if i % 2 else -1.0, (sample(hf_model, f"r{i}", list(range(10, 250))),))
            for i in range(160)
        ]
        killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        with pytest.raises(TrainerRankFailed, match="rank 1 died"):
            trainer.step(items)
        killer.join()
        assert time.monotonic() - started < 60
        assert not trainer.running  # every rank was stopped, none left waiting
        with pytest.raises(TrainerRankFailed, match="not running"):
            trainer.step(items[:2])

        trainer.restart()
        assert trainer.load(store, 0) == 0
        out = trainer.step(items[:2])
        assert out.updated and out.rollouts == 2
    finally:
        trainer.close()


def pushed(
    trainer: RankedTrainer, bucket_bytes: int, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Everything a bucketed push delivers (copied out of each bucket while it is valid)."""
    out: dict[str, torch.Tensor] = {}
    count = 0
    for bucket in trainer.weight_buckets(bucket_bytes, dtype):
        assert bucket.index == count
        count += 1
        for name, tensor in bucket_tensors(bucket):
            assert name not in out
            out[name] = tensor.clone()
        path = bucket.path
    assert bucket.last and count > 1
    assert not Path(path).exists()  # the bucket file is gone once the push ends
    return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_ranks_write_their_shards_into_the_buckets(
    two_ranks: RankedTrainer, dtype: torch.dtype | None
) -> None:
    """Each rank writes its own rows (no gather): the buckets hold exactly the whole weights,
    a tied LM head left out, for buckets smaller than one tensor too."""
    whole = two_ranks.state_dict_for_engine()  # gathered: the reference
    got = pushed(two_ranks, 3000, dtype)
    assert got.keys() == whole.keys() - {"lm_head.weight"}
    for name, tensor in got.items():
        expected = whole[name] if dtype is None else whole[name].to(dtype)
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name


def test_lora_over_two_ranks_steps_pushes_and_checkpoints_as_one(
    tiny_model_dir: Path, hf_model: Any, tmp_path: Path
) -> None:
    options: dict[str, Any] = {"lr": LR, "lora_rank": 4, "lora_alpha": 8}
    one = VerlFSDPTrainer(tiny_model_dir, **options)
    two = RankedTrainer(tiny_model_dir, ranks=2, threads=1, **options)
    try:
        # The adapters start at B = 0 (random A): the step is what makes the merge non-trivial.
        items = batch(hf_model)
        a, b = one.step(items), two.step(items)
        assert a.updated and b.updated
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
        merged = one.state_dict_for_engine()
        assert_same_weights(two.state_dict_for_engine(), merged)
        # The push carries the adapters alone, gathered from both ranks: one rank's adapters.
        got, reference = pushed(two, 2_000), dict(one._adapter_tensors())
        assert got.keys() == reference.keys() and len(got) == 28
        assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in got)
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=5e-3 * LR, msg=name)

        # Checkpointed: the adapters (and their optimizer state) only, the base being the
        # model directory's; a fresh trainer of another world size loads them back.
        store = ShardedStore(tmp_path / "checkpoints")
        two.global_step = 1
        path = two.save(store, 1)
        assert store.manifest(1).trainable_only
        stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        base = [k for k in stored if k.startswith("model.") and "lora_" not in k]
        assert base in ([], ["model.base_model.model.lm_head.weight"])  # (an alias of the embedding)
        fresh = VerlFSDPTrainer(tiny_model_dir, **options)
        assert fresh.load(store, 1) == 1
        loaded = fresh.state_dict_for_engine()
        for name, tensor in two.state_dict_for_engine().items():
            assert torch.equal(loaded[name], tensor), name
    finally:
        two.close()


@pytest.mark.parametrize("bucket_bytes", [None, 20_000])
def test_export_from_ranks_is_written_bucket_by_bucket(
    two_ranks: RankedTrainer, tiny_model_dir: Path, tmp_path: Path, bucket_bytes: int | None
) -> None:
    """The HF export is written from the push's buckets (one safetensors shard each, an index
    when there are several): it loads with transformers as the trainer's weights."""
    if bucket_bytes is None:
        out = two_ranks.export_hf(tmp_path / "final")
        assert (out / "model.safetensors").is_file()
    else:
        out = export_hf_model(
            buckets_to_hf(two_ranks.weight_buckets(bucket_bytes)), tiny_model_dir, tmp_path / "f"
        )
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    exported: Any = AutoModelForCausalLM.from_pretrained(out)
    loaded = exported.state_dict()
    for name, tensor in two_ranks.state_dict_for_engine().items():
        assert torch.equal(loaded[name], tensor), name


def test_ranks_are_placed_on_the_gpus_given() -> None:
    """The placement's training GPUs reach each rank as its device (checked before spawning)."""
    options = {"lr": LR}
    assert rank_options(options, None, 1) == options
    assert rank_options(options, (4, 5, 6, 7), 2) == {"lr": LR, "device": "cuda:6"}
    with pytest.raises(ValueError, match="2 trainer ranks need 2 distinct GPUs"):
        RankGroup("unused", 2, options, gpus=(3,))
    with pytest.raises(ValueError, match="distinct"):
        RankGroup("unused", 2, options, gpus=(3, 3))


def test_ranks_restarted_while_offloaded_offload_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that fails while the engine generates (the push, a checkpoint) is restarted then:
    fresh ranks hold their whole state on the GPU, beside a collocated vLLM that wakes next,
    unless they offload as the ones they replace had. Only the commands are recorded here (no
    process is spawned)."""
    sent: list[str] = []

    def broadcast(self: RankGroup, command: Any, **kw: Any) -> list[Any]:
        sent.append(type(command).__name__)
        return []

    monkeypatch.setattr(RankGroup, "start", lambda self: sent.append("start"))
    monkeypatch.setattr(RankGroup, "kill", lambda self: sent.append("kill"))
    monkeypatch.setattr(RankGroup, "broadcast", broadcast)
    trainer = RankedTrainer("unused", ranks=2)
    trainer.restart()
    trainer.offload()
    trainer.restart()
    trainer.onload()
    trainer.restart()
    assert sent == [
        "start", "kill", "start", "Offload", "kill", "start", "Offload", "Onload", "kill", "start"
    ]  # fmt: skip
