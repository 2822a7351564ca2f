"""The torch engine: the engine contract, plus what only this implementation promises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from appliance.engines.base import GenerateRequest, SamplingParams
from appliance.engines.torch_engine import TorchEngine
from appliance.errors import BadRequest, EngineUnavailable
from tests.appliance.engines.contract import PROMPTS, EngineContract, generate, greedy, unsampled_id


class TestTorchEngine(EngineContract):
    @pytest_asyncio.fixture(loop_scope="function")
    async def engine(self, tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
        engine = TorchEngine(tiny_model_dir, max_batch_size=8)
        await engine.start()
        yield engine
        await engine.close()

    async def test_default_stop_is_the_models_eos(self, engine: TorchEngine) -> None:
        stop = await unsampled_id(engine, PROMPTS[1], 10)
        full = await generate(engine, PROMPTS[1], greedy(10, [stop]))
        assert engine._eos_ids == {2}  # <|im_end|>, from config and generation_config
        engine._eos_ids = frozenset({full.token_ids[3]})
        result = await generate(engine, PROMPTS[1], greedy(10))
        assert result.finish_reason == "stop"
        assert result.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]

    @pytest.mark.parametrize(
        "params",
        [
            SamplingParams(max_tokens=0),
            SamplingParams(temperature=-0.5),
            SamplingParams(temperature=float("nan")),
            SamplingParams(top_p=0.0),
            SamplingParams(top_p=1.5),
        ],
    )
    async def test_rejects_bad_params(self, engine: TorchEngine, params: SamplingParams) -> None:
        with pytest.raises(BadRequest):
            await generate(engine, PROMPTS[1], params)

    async def test_rejects_ids_outside_the_vocabulary(self, engine: TorchEngine) -> None:
        for bad in ([1, -1], [1, 10**6]):
            with pytest.raises(BadRequest, match="token ids"):
                await generate(engine, bad, greedy(2))

    async def test_load_weights_checks_keys_and_shapes(
        self, engine: TorchEngine, reference_model: Any
    ) -> None:
        weights = dict(reference_model.state_dict())
        with pytest.raises(BadRequest, match="missing"):
            await engine.load_weights({k: v for k, v in weights.items() if "layers.1." not in k}, 1)
        with pytest.raises(BadRequest, match="wrong shapes"):
            await engine.load_weights({**weights, "model.norm.weight": torch.ones(3)}, 1)
        assert engine.policy_version == 0
        # A tied lm_head may be left out, as safetensors checkpoints do.
        await engine.load_weights({k: v for k, v in weights.items() if k != "lm_head.weight"}, 7)
        assert engine.policy_version == 7

    async def test_requests_queued_during_a_batch_run_in_the_next(self, engine: TorchEngine) -> None:
        first = asyncio.create_task(generate(engine, PROMPTS[0], greedy(200, [self.unreachable_stop_id])))
        await asyncio.sleep(0.05)
        late = await generate(engine, PROMPTS[1], greedy(2))
        done = await first
        # The late request waited for the whole first batch, then decoded alone.
        assert late.queue_s > 0.02
        assert done.finish_reason == "length"
        assert not engine._running and engine._queue.empty()

    async def test_cancelled_rows_leave_the_batch(self, engine: TorchEngine) -> None:
        long = greedy(1500, [self.unreachable_stop_id])
        tasks = [asyncio.create_task(generate(engine, PROMPTS[i], long)) for i in range(3)]
        await asyncio.sleep(0.2)
        assert len(engine._running) == 3
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(50):  # the decode thread notices within one step
            if not engine._running:
                break
            await asyncio.sleep(0.01)
        assert not engine._running
        assert all(task.cancelled() for task in tasks)

    async def test_not_started(self, tiny_model_dir: Path) -> None:
        engine = TorchEngine(tiny_model_dir)
        with pytest.raises(EngineUnavailable, match="not been started"):
            await generate(engine, PROMPTS[0], greedy(2))
        await engine.close()
        with pytest.raises(EngineUnavailable):
            await engine.start()


@pytest.mark.gpu
class TestTorchEngineCuda(EngineContract):
    @pytest_asyncio.fixture(loop_scope="function")
    async def engine(self, tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        engine = TorchEngine(tiny_model_dir, device="cuda", max_batch_size=8)
        await engine.start()
        yield engine
        await engine.close()


async def test_sleep_refuses_generation_until_woken(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir)
    await engine.start()
    try:
        request = GenerateRequest(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=3, temperature=0))
        before = await engine.generate(request)
        await engine.sleep(1)
        assert engine.is_sleeping
        with pytest.raises(EngineUnavailable):
            await engine.generate(request)
        await engine.wake(["weights"])
        assert engine.is_sleeping
        await engine.wake(["kv_cache"])
        assert not engine.is_sleeping
        assert (await engine.generate(request)).token_ids == before.token_ids
    finally:
        await engine.close()
