"""LoRA pushed alone: a LoRA-trained policy reaches the torch engine as its adapters (a few KB
here, never the merged model), is served on top of the base weights with the trainer's own
computation, and a push that does not fit changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from appliance.engines import lora
from appliance.engines.torch_engine import TorchEngine
from contracts.errors import BadRequest
from tests.appliance.engines.contract import PROMPTS, generate, greedy
from tests.trainer.helpers import sample
from trainer.buckets import (
    LoraAdapter,
    WeightBucket,
    adapter_pairs,
    bucket_tensors,
    pack_buckets,
    stream_buckets,
)
from trainer.items import TrainItem
from trainer.verl_backend import VerlFSDPTrainer
from trainer.verl_lora import adapter_name

GOOD = [10, 11, 12]
#: A stop id no sampled token equals: runs go on to their length.
NEVER = -1


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path) -> Iterator[VerlFSDPTrainer]:
    """A LoRA trainer after two steps (B != 0, so the adapters change what the model computes)."""
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=5e-2, lora_rank=4, lora_alpha=16)
    hf: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for _ in range(2):
        out = trainer.step([TrainItem("A", 1.0, (sample(hf, "A", GOOD),))])
        assert out.updated
    yield trainer


@pytest_asyncio.fixture(loop_scope="function")
async def engine(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
    engine = TorchEngine(tiny_model_dir, max_batch_size=4)
    await engine.start()
    yield engine
    await engine.close()


def trainer_adapters(trainer: VerlFSDPTrainer) -> dict[str, torch.Tensor]:
    """The trainer's adapters, read from its module (not through a push)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in trainer.engine.module.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            local = value.to_local() if isinstance(value, DTensor) else value
            out[adapter_name(name)] = local.detach().clone()
    return out


async def served_merged(tiny_model_dir: Path, trainer: VerlFSDPTrainer, prompt: list[int]) -> Any:
    """What an engine holding the merged weights generates (the reference)."""
    merged = TorchEngine(tiny_model_dir, max_batch_size=4)
    await merged.start()
    try:
        await merged.load_weights(trainer.state_dict_for_engine(), 1)
        return await generate(merged, prompt, greedy(12, [NEVER]))
    finally:
        await merged.close()


async def test_a_lora_push_carries_the_adapters_alone_and_serves_the_trainers_policy(
    engine: TorchEngine, trained: VerlFSDPTrainer, tiny_model_dir: Path
) -> None:
    base = {k: v.clone() for k, v in engine._model.state_dict().items()}
    pushed: list[WeightBucket] = []
    nbytes = 0

    async def watched() -> AsyncIterator[WeightBucket]:
        nonlocal nbytes
        async for bucket in stream_buckets(trained.weight_buckets(4096)):
            pushed.append(bucket)
            nbytes += sum(e.nbytes for e in bucket.entries)
            yield bucket

    before = await generate(engine, PROMPTS[3], greedy(12, [NEVER]))
    await engine.load_weight_buckets(watched(), 1)
    assert engine.policy_version == 1
    # Only adapters travel, every bucket says so, and they are a small part of the model.
    assert all(b.adapter == LoraAdapter(4, 16.0) for b in pushed) and len(pushed) > 1
    model_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert nbytes < model_bytes / 5
    # Served bit for bit: the trainer's adapters, on the untouched base weights.
    served = lora.served_adapter(engine._model)
    expected = trainer_adapters(trained)
    assert served.keys() == expected.keys() and len(adapter_pairs(served)) == 14
    for name, tensor in expected.items():
        assert torch.equal(served[name], tensor), name
    for name, tensor in engine._model.state_dict().items():
        assert torch.equal(tensor, base[name]), name
    # The policy served is the trainer's: the same tokens and log-probs as its merged weights.
    after = await generate(engine, PROMPTS[3], greedy(12, [NEVER]))
    reference = await served_merged(tiny_model_dir, trained, PROMPTS[3])
    assert after.token_ids == reference.token_ids and after.token_ids != before.token_ids
    assert after.logprobs == pytest.approx(reference.logprobs, abs=1e-5)

    # Whole weights replace the adapter; a later adapter push reads the base weights back.
    await engine.load_weights(trained.state_dict_for_engine(), 2)
    assert lora.served_adapter(engine._model) == {}
    merged = await generate(engine, PROMPTS[3], greedy(12, [NEVER]))
    assert merged.logprobs == pytest.approx(reference.logprobs, abs=1e-6)
    # Level 2 drops the weights, and a wake gives them fresh (uninitialised) storage: the next
    # adapter push reads the base back, after whole weights (version 3) as after an adapter
    # (version 4: it was served on the wake's storage, NaNs).
    for version in (3, 4):
        await engine.sleep(2)
        await engine.wake()
        await engine.load_weight_buckets(stream_buckets(trained.weight_buckets(1 << 20)), version)
        for name, tensor in engine._model.state_dict().items():
            assert torch.equal(tensor, base[name]), (version, name)
        again = await generate(engine, PROMPTS[3], greedy(12, [NEVER]))
        # (fresh allocations after the sleep may sum in another order: float rounding only)
        assert again.token_ids == after.token_ids, version
        assert again.logprobs == pytest.approx(after.logprobs, abs=1e-5), version


#: The adapter of the made-up pushes below.
RANK_2 = LoraAdapter(2, 4.0)


def adapter_push(tensors: dict[str, torch.Tensor], bucket_bytes: int = 512) -> AsyncIterator[WeightBucket]:
    return stream_buckets(pack_buckets(tensors.items(), bucket_bytes=bucket_bytes, adapter=RANK_2))


def random_adapter(model: Any, rank: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in lora.linear_shapes(model).items():
        if name.startswith("model.layers.0."):
            out[f"{name}.lora_A.weight"] = torch.randn(rank, cols, generator=g)
            out[f"{name}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.1
    return out


async def test_adapter_pushes_that_do_not_fit_change_nothing(engine: TorchEngine) -> None:
    good = random_adapter(engine._model)
    await engine.load_weight_buckets(adapter_push(good), 1)
    served = await generate(engine, PROMPTS[2], greedy(8, [NEVER]))
    q = "model.layers.0.self_attn.q_proj"
    nope = {"model.nope.lora_A.weight": torch.ones(2, 3), "model.nope.lora_B.weight": torch.ones(3, 2)}
    bad_pushes: list[tuple[dict[str, torch.Tensor], str]] = [
        ({**good, "model.layers.0.nope.lora_A.weight": torch.ones(2, 3)}, "lack their A or B"),
        ({**good, **nope}, "not its linear"),
        ({**good, f"{q}.lora_A.weight": torch.ones(3, good[f"{q}.lora_A.weight"].shape[1])}, "wrong shapes"),
        ({**good, "model.norm.weight": torch.ones(3)}, "not a LoRA adapter weight"),
    ]
    for tensors, message in bad_pushes:
        with pytest.raises(BadRequest, match=message):
            await engine.load_weight_buckets(adapter_push(tensors), 2)
    # A push mixing adapter and whole-weight buckets, and one that stops early.
    mixed = [b async for b in adapter_push(good)]
    assert len(mixed) > 1

    async def mixing() -> AsyncIterator[WeightBucket]:
        async for bucket in adapter_push(good):
            plain = WeightBucket(bucket.path, bucket.entries, bucket.index, bucket.last)
            yield bucket if bucket.index == 0 else plain

    with pytest.raises(BadRequest, match="does not belong"):
        await engine.load_weight_buckets(mixing(), 2)

    async def early() -> AsyncIterator[WeightBucket]:
        async for bucket in adapter_push(good):
            if not bucket.last:
                yield bucket

    with pytest.raises(BadRequest, match="ended before"):
        await engine.load_weight_buckets(early(), 2)
    # Nothing changed: the first adapter serves on, at its version.
    assert engine.policy_version == 1 and not engine.needs_weights
    again = await generate(engine, PROMPTS[2], greedy(8, [NEVER]))
    assert (again.token_ids, again.logprobs) == (served.token_ids, served.logprobs)


def test_a_peft_adapter_directory_loads_in_peft_as_pushed(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The files the vLLM engine hands its server: peft reads them back as the same adapter."""
    from peft import PeftModel

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tensors = random_adapter(model, rank=4, seed=1)
    buckets = pack_buckets(tensors.items(), bucket_bytes=1 << 20, adapter=LoraAdapter(4, 8.0))
    bucket = next(buckets)
    assert bucket.last
    weights = lora.AdapterWeights(LoraAdapter(4, 8.0), {n: t.clone() for n, t in bucket_tensors(bucket)})
    buckets.close()
    directory = lora.write_peft_adapter(tmp_path / "adapter", weights)
    stored = load_file(str(directory / "adapter_model.safetensors"))
    assert stored.keys() == {f"base_model.model.{name}" for name in tensors}
    peft_model: Any = PeftModel.from_pretrained(model, str(directory))
    x = torch.tensor([PROMPTS[4]])
    with torch.no_grad():
        got = peft_model(input_ids=x).logits
        plain: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        pairs = lora.check_adapter(weights, lora.linear_shapes(plain))
        lora.attach(plain, weights.adapter, pairs)
        ours = plain(input_ids=x).logits
    torch.testing.assert_close(ours, got, rtol=0, atol=1e-5)
    assert lora.detach(plain) == 7 and lora.served_adapter(plain) == {}


def test_vllm_max_lora_rank() -> None:
    assert [lora.vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 64, 512)] == [1, 8, 8, 16, 64, 512]
    with pytest.raises(ValueError, match="up to 512"):
        lora.vllm_max_lora_rank(513)
