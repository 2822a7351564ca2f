"""The engine fleet over real torch engines on the tiny model: the engine contract, routing with
rollout affinity, failover, pushes to every replica (the bucket tee), sleep and wake, the factory,
and one whole appliance step served by two replicas. The vLLM fleet: ``test_vllm_fleet.py``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from appliance import app as app_module
from appliance.app import Appliance
from appliance.config import ApplianceConfig
from appliance.engines.base import Engine, GenerateRequest, GenerateResult, SamplingParams, WeightGroupMember
from appliance.engines.factory import create_engine, replica_devices, visible_ids
from appliance.engines.fleet import EngineFleet
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.vllm_engine import VLLMEngine
from appliance.engines.vllm_process import server_command, server_env
from contracts.errors import ConfigError, EngineUnavailable
from tests.appliance.engines.contract import PROMPTS, EngineContract, greedy
from tests.support import make_config
from trainer.buckets import WeightBucket, close_stream, pack_buckets, stream_buckets


class TestEngineFleet(EngineContract):
    """Two torch replicas behind one ``Engine``: the contract holds for the fleet as a whole."""

    @pytest_asyncio.fixture(loop_scope="function")
    async def engine(self, tiny_model_dir: Path) -> AsyncIterator[EngineFleet]:
        fleet = EngineFleet([TorchEngine(tiny_model_dir, max_batch_size=8) for _ in range(2)])
        await fleet.start()
        yield fleet
        await fleet.close()


class Replica:
    """A torch engine as a fleet's replica, for tests: records the affinity of every call it
    serves; ``broken`` fails calls with ``EngineUnavailable`` (as a server that died does) while
    it still says it is up; ``bucket_delay_s`` reads every pushed bucket that much later;
    ``fail_after_buckets`` raises in the middle of a push."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.calls: list[str | None] = []
        self.broken = False
        self.bucket_delay_s = 0.0
        self.fail_after_buckets: int | None = None

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def needs_weights(self) -> bool:
        return self.engine.needs_weights

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    @property
    def down_reason(self) -> str | None:
        return self.engine.down_reason

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.close()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.broken:
            raise EngineUnavailable("the replica's server died; retry")
        self.calls.append(request.affinity)
        return await self.engine.generate(request)

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await self.engine.load_weights(state_dict, version)

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        async def relay() -> AsyncIterator[WeightBucket]:
            count = 0
            async for bucket in buckets:
                if count == self.fail_after_buckets:
                    raise RuntimeError("the replica failed in the middle of a push")
                # Read late: had the fleet read on, the file would hold the next bucket by now.
                await asyncio.sleep(self.bucket_delay_s)
                yield bucket
                count += 1

        try:
            await self.engine.load_weight_buckets(relay(), version)
        finally:
            await close_stream(buckets)

    async def sleep(self, level: int = 1) -> None:
        await self.engine.sleep(level)

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        await self.engine.wake(tags)


@pytest_asyncio.fixture(loop_scope="function")
async def replicas(tiny_model_dir: Path) -> AsyncIterator[list[Replica]]:
    engines = [Replica(TorchEngine(tiny_model_dir, max_batch_size=8)) for _ in range(2)]
    yield engines
    for replica in engines:
        await replica.close()


@pytest_asyncio.fixture(loop_scope="function")
async def fleet(replicas: list[Replica]) -> AsyncIterator[EngineFleet]:
    fleet = EngineFleet(replicas, failure_cooldown_s=60.0)
    await fleet.start()
    yield fleet
    await fleet.close()


async def call(fleet: Engine, affinity: str | None, max_tokens: int = 3) -> GenerateResult:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    return await fleet.generate(GenerateRequest(prompt_ids=PROMPTS[2], params=params, affinity=affinity))


def perturbed_state(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights plus noise, without the LM head (tied to the embedding)."""
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    noise = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.1 * torch.randn(tensor.shape, generator=noise)
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }


def assert_serves(replica: Replica, state: Mapping[str, torch.Tensor]) -> None:
    """The replica's parameters are exactly ``state`` (bit for bit)."""
    served = replica.engine._model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(served[name], tensor), name
    assert torch.equal(served["lm_head.weight"], state["model.embed_tokens.weight"])


def exists(path: str) -> bool:
    return Path(path).exists()


def buckets_of(state: Mapping[str, torch.Tensor], paths: list[str]) -> AsyncGenerator[WeightBucket, None]:
    """``state`` in buckets of 4 KB (a few parameters each, the embedding alone), each file
    path noted in ``paths`` as the bucket is read."""

    async def watched() -> AsyncGenerator[WeightBucket, None]:
        async for bucket in stream_buckets(pack_buckets(state.items(), bucket_bytes=4096)):
            paths.append(bucket.path)
            yield bucket

    return watched()


# --- routing -------------------------------------------------------------------------------


async def test_a_rollouts_calls_stay_on_its_replica_and_new_rollouts_balance(
    fleet: EngineFleet, replicas: list[Replica]
) -> None:
    for turn in range(3):
        for rollout in ("r0", "r1", "r2", "r3"):
            await call(fleet, rollout)
        if turn == 0:
            assert [fleet.replica_of(r) for r in ("r0", "r1", "r2", "r3")] == [0, 1, 0, 1]
    assert replicas[0].calls == ["r0", "r2"] * 3
    assert replicas[1].calls == ["r1", "r3"] * 3
    assert [s.rollouts for s in fleet.status()] == [2, 2]

    # Fewest requests in flight comes first, fewest rollouts second.
    fleet.release("r0")
    fleet.release("r2")
    started = asyncio.Event()
    long = asyncio.create_task(
        fleet.generate(
            GenerateRequest(
                prompt_ids=PROMPTS[0],
                params=greedy(2000 - len(PROMPTS[0]), [-1]),
                on_token=lambda token, logprob: started.set(),
            )
        )
    )
    await asyncio.wait_for(started.wait(), 60)
    assert [s.inflight for s in fleet.status()] == [1, 0]  # no rollouts on 0: the long call went there
    await call(fleet, "x")
    await call(fleet, "y")  # replica 1 has a rollout more, but no call in flight
    assert (fleet.replica_of("x"), fleet.replica_of("y")) == (1, 1)
    long.cancel()
    await asyncio.gather(long, return_exceptions=True)
    # A call without an affinity goes to the least loaded replica and is remembered nowhere.
    await call(fleet, None)
    assert replicas[0].calls[-1] is None and [s.rollouts for s in fleet.status()] == [0, 4]


async def test_released_and_least_recently_used_affinities_are_forgotten(tiny_model_dir: Path) -> None:
    fleet = EngineFleet([TorchEngine(tiny_model_dir) for _ in range(2)], max_affinities=2)
    await fleet.start()
    try:
        for rollout in ("a", "b", "c"):
            await call(fleet, rollout, max_tokens=1)
        assert fleet.replica_of("a") is None  # the least recently used went when "c" came
        assert (fleet.replica_of("b"), fleet.replica_of("c")) == (1, 0)
        fleet.release("b")
        fleet.release("b")  # twice: nothing more happens
        fleet.release("never seen")
        assert fleet.replica_of("b") is None
        assert [s.rollouts for s in fleet.status()] == [1, 0]
    finally:
        await fleet.close()


# --- failover -------------------------------------------------------------------------------


async def test_a_replica_whose_calls_fail_gets_no_new_rollouts_and_its_rollouts_move(
    tiny_model_dir: Path,
) -> None:
    replicas = [Replica(TorchEngine(tiny_model_dir)) for _ in range(2)]
    fleet = EngineFleet(replicas, failure_cooldown_s=1.0)
    await fleet.start()
    try:
        await call(fleet, "r0")
        await call(fleet, "r1")
        assert (fleet.replica_of("r0"), fleet.replica_of("r1")) == (0, 1)

        replicas[1].broken = True
        # It failed before handing over a token: the fleet tries the call once more elsewhere.
        await call(fleet, "r1")
        assert fleet.replica_of("r1") == 0
        assert fleet.status()[1].state == "cooling down"
        await call(fleet, "r2")  # a new rollout: replica 0 although it holds both others
        assert fleet.replica_of("r2") == 0
        assert replicas[0].calls == ["r0", "r1", "r2"]
        # With no other replica to try, the call fails as it would on one engine (a retryable 503).
        replicas[0].broken = True
        with pytest.raises(EngineUnavailable):
            await call(fleet, "r1")
        assert fleet.replica_of("r1") is None
        replicas[0].broken = False

        # Back after the cool-down: new rollouts go to the replica with the fewest again.
        replicas[1].broken = False
        await asyncio.sleep(1.1)
        assert fleet.status()[1].state == "live"
        await call(fleet, "r3")
        assert fleet.replica_of("r3") == 1 and replicas[1].calls == ["r1", "r3"]
    finally:
        await fleet.close()


async def test_a_closed_replica_is_left_out_of_routing_and_pushes(
    fleet: EngineFleet, replicas: list[Replica], tiny_model_dir: Path
) -> None:
    await call(fleet, "r0")
    await call(fleet, "r1")
    await replicas[1].close()  # down for good (like a vLLM server whose restarts gave up)
    assert fleet.status()[1].state == "closed"
    await call(fleet, "r1")  # moves before anything fails
    await call(fleet, "r2")
    assert (fleet.replica_of("r1"), fleet.replica_of("r2")) == (0, 0)

    state = perturbed_state(tiny_model_dir, 1)
    await fleet.load_weight_buckets(buckets_of(state, []), 1)  # the replica that is down is left out
    await fleet.sleep(1)
    await fleet.wake()
    assert fleet.policy_version == 1 and not fleet.needs_weights and not fleet.is_sleeping
    assert_serves(replicas[0], state)
    assert (await call(fleet, "r1")).policy_version == 1

    # No replica left: calls fail retryably, naming what each replica is doing.
    await replicas[0].close()
    with pytest.raises(EngineUnavailable, match=r"no engine replica .*replica 0: closed; replica 1: closed"):
        await call(fleet, "r1")


async def test_a_replica_that_needs_weights_or_missed_a_push_is_avoided_until_pushed(
    fleet: EngineFleet, replicas: list[Replica], tiny_model_dir: Path
) -> None:
    await call(fleet, "r0")
    await call(fleet, "r1")
    # Replica 1 alone loses its weights (as a vLLM server restarted after a bucketed push does).
    await replicas[1].sleep(2)
    await replicas[1].wake()
    assert replicas[1].needs_weights and fleet.needs_weights
    assert fleet.status()[1].state == "needs weights"
    await call(fleet, "r1")
    await call(fleet, "r2")
    assert (fleet.replica_of("r1"), fleet.replica_of("r2")) == (0, 0)

    # What the scheduler does when needs_weights is True: push the published version to all.
    state = perturbed_state(tiny_model_dir, 2)
    await fleet.load_weight_buckets(buckets_of(state, []), 1)
    assert not fleet.needs_weights and [s.state for s in fleet.status()] == ["live", "live"]
    await call(fleet, "r3")
    assert fleet.replica_of("r3") == 1

    # A replica on another version than the fleet's (it missed a push) gets no calls.
    await replicas[0].load_weights(state, 7)
    assert fleet.needs_weights and fleet.status()[0].state == "stale"
    result = await call(fleet, "r0")  # moves to replica 1, which serves the fleet's version
    assert (fleet.replica_of("r0"), result.policy_version, fleet.policy_version) == (1, 1, 1)


# --- weights, sleep, wake on every replica -----------------------------------------------------


async def test_a_bucketed_push_reaches_every_replica_bit_for_bit(
    fleet: EngineFleet, replicas: list[Replica], tiny_model_dir: Path
) -> None:
    """One stream read once, two replicas, the second reading each bucket late: the fleet reads
    the next bucket (which overwrites the file) only when both are done with this one."""
    replicas[1].bucket_delay_s = 0.01
    state = perturbed_state(tiny_model_dir, 3)
    paths: list[str] = []
    await fleet.load_weight_buckets(buckets_of(state, paths), 4)
    assert len(paths) > 5 and len(set(paths)) == 1 and not exists(paths[0])
    assert fleet.policy_version == 4 and [r.policy_version for r in replicas] == [4, 4]
    for replica in replicas:
        assert_serves(replica, state)
    after = [await call(fleet, rollout) for rollout in ("r0", "r1")]
    assert [r.policy_version for r in after] == [4, 4]
    assert [replica.calls for replica in replicas] == [["r0"], ["r1"]]

    # Whole weights (a state dict) reach both too.
    await fleet.load_weights(perturbed_state(tiny_model_dir, 4), 5)
    assert [r.policy_version for r in replicas] == [5, 5] and fleet.policy_version == 5


async def test_a_replica_that_fails_a_push_raises_without_wedging_the_other(
    fleet: EngineFleet, replicas: list[Replica], tiny_model_dir: Path
) -> None:
    replicas[0].fail_after_buckets = 2
    state = perturbed_state(tiny_model_dir, 5)
    paths: list[str] = []
    async with asyncio.timeout(60):
        with pytest.raises(RuntimeError, match="middle of a push"):
            await fleet.load_weight_buckets(buckets_of(state, paths), 1)
    assert paths and not exists(paths[0])  # the producer was closed: its file is gone
    # The other replica took the whole push and serves it; the failed one waits for the next.
    assert_serves(replicas[1], state)
    assert fleet.policy_version == 1 and replicas[0].needs_weights and fleet.needs_weights
    assert (await call(fleet, "r0")).policy_version == 1
    assert fleet.replica_of("r0") == 1

    replicas[0].fail_after_buckets = None
    await fleet.load_weight_buckets(buckets_of(state, []), 1)
    assert not fleet.needs_weights
    for replica in replicas:
        assert_serves(replica, state)


async def test_a_stream_that_fails_fails_the_push_on_every_replica(
    fleet: EngineFleet, replicas: list[Replica], tiny_model_dir: Path
) -> None:
    state = perturbed_state(tiny_model_dir, 6)
    paths: list[str] = []

    async def breaks() -> AsyncIterator[WeightBucket]:
        async with contextlib.aclosing(buckets_of(state, paths)) as source:
            async for bucket in source:
                if bucket.index == 3:
                    raise ValueError("a trainer rank died")
                yield bucket

    async with asyncio.timeout(60):
        with pytest.raises(ValueError, match="rank died"):
            await fleet.load_weight_buckets(breaks(), 1)
    assert not exists(paths[0])
    assert fleet.policy_version == 0 and all(r.needs_weights for r in replicas)
    with pytest.raises(EngineUnavailable):
        await call(fleet, "r0")
    await fleet.load_weight_buckets(buckets_of(state, []), 1)
    assert (await call(fleet, "r0")).policy_version == 1


async def test_sleep_and_wake_reach_every_replica(fleet: EngineFleet, replicas: list[Replica]) -> None:
    before = await call(fleet, "r0")
    await fleet.sleep(1)
    assert fleet.is_sleeping and all(r.is_sleeping for r in replicas)
    with pytest.raises(EngineUnavailable, match="asleep"):
        await call(fleet, "r0")
    await fleet.wake(["weights"])
    assert fleet.is_sleeping
    await fleet.wake(["kv_cache"])
    assert not fleet.is_sleeping and not any(r.is_sleeping for r in replicas)
    assert (await call(fleet, "r0")).token_ids == before.token_ids
    assert fleet.replica_of("r0") == 0  # a fleet-wide sleep moves no rollout

    await fleet.sleep(2)
    await fleet.wake()
    assert fleet.needs_weights and all(r.needs_weights for r in replicas)


async def test_a_replica_that_fails_to_start_closes_the_others(tiny_model_dir: Path, tmp_path: Path) -> None:
    good = TorchEngine(tiny_model_dir)
    fleet = EngineFleet([good, TorchEngine(tmp_path / "no-model")])
    with pytest.raises(OSError):
        await fleet.start()
    assert good.down_reason == "closed"
    with pytest.raises(EngineUnavailable, match="closed"):
        await call(fleet, "r0")


def test_replicas_must_agree_on_the_version(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="different policy versions"):
        EngineFleet([TorchEngine(tiny_model_dir), TorchEngine(tiny_model_dir, policy_version=3)])
    with pytest.raises(ValueError, match="at least one"):
        EngineFleet([])


# --- the factory ------------------------------------------------------------------------------


def test_the_factory_builds_a_fleet_per_engine_replicas(tmp_path: Path, tiny_model_dir: Path) -> None:
    def config(**overrides: object) -> ApplianceConfig:
        return make_config(tmp_path, tiny_model_dir, **overrides)

    assert isinstance(create_engine(config(), tiny_model_dir), TorchEngine)
    torch_fleet = create_engine(config(engine_replicas=2), tiny_model_dir)
    assert isinstance(torch_fleet, EngineFleet) and len(torch_fleet.replicas) == 2
    assert all(isinstance(e, TorchEngine) for e in torch_fleet.replicas)

    on_gpus = config(engine="vllm", engine_replicas=3, tensor_parallel_size=2, device="cuda", vllm_port=9100)
    fleet = create_engine(on_gpus, tiny_model_dir)
    assert isinstance(fleet, EngineFleet)
    servers = [e for e in fleet.replicas if isinstance(e, VLLMEngine)]
    assert [s._settings.visible_devices for s in servers] == ["0,1", "2,3", "4,5"]
    assert [s._port for s in servers] == [9100, 9101, 9102]
    assert [s._log_path.name for s in servers] == ["vllm-0.log", "vllm-1.log", "vllm-2.log"]
    env = server_env(servers[1]._settings, tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["APPLIANCE_ADAPTER_DIR"] == str(tmp_path / "adapters")  # removed with the server

    single = create_engine(config(engine="vllm", device="cpu"), tiny_model_dir)
    assert isinstance(single, VLLMEngine) and single._settings.visible_devices is None
    assert single._log_path.name == "vllm.log"
    on_cpu = create_engine(config(engine="vllm", engine_replicas=2, device="cpu"), tiny_model_dir)
    assert isinstance(on_cpu, EngineFleet)
    assert all(isinstance(e, VLLMEngine) and e._settings.visible_devices is None for e in on_cpu.replicas)
    with pytest.raises(ConfigError, match="vllm_url"):
        create_engine(config(engine="vllm", engine_replicas=2, vllm_url="http://127.0.0.1:1"), tiny_model_dir)


def test_replica_devices_follow_the_visible_gpus() -> None:
    assert replica_devices(0, 1) == "0" and replica_devices(3, 1) == "3"
    assert replica_devices(1, 4) == "4,5,6,7"
    assert replica_devices(1, 2, "7,6,5,4") == "5,4"
    assert replica_devices(0, 2, " ") == "0,1"
    with pytest.raises(ConfigError, match="lists 4"):
        replica_devices(2, 2, "0,1,2,3")
    # The placement's GPUs (CUDA's numbering here) through this process's CUDA_VISIBLE_DEVICES.
    assert visible_ids((4, 6)) == "4,6"
    assert visible_ids((4, 6), "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f,GPU-g") == "GPU-e,GPU-g"


def test_vllm_servers_get_the_placements_gpus_and_cuda_graphs_on_gpu(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """What each vLLM replica is launched with (nothing launched: the command and environment)."""
    config = make_config(tmp_path, tiny_model_dir, engine="vllm", engine_replicas=2, device="cuda")
    fleet = create_engine(config, tiny_model_dir, replica_gpus=[(2, 3), (6, 7)])
    assert isinstance(fleet, EngineFleet)
    settings = [replica._settings for replica in fleet.replicas]  # type: ignore[attr-defined]
    assert [s.visible_devices for s in settings] == ["2,3", "6,7"]
    commands = [server_command(s, 8000) for s in settings]
    assert all("--enforce-eager" not in c and "--enable-sleep-mode" in c for c in commands)
    # Asleep, the CUDA graph pool goes to host RAM too (vLLM 0.33 keeps it on the GPU otherwise).
    assert all("--sleep-mode-offload-cudagraph" in c for c in commands)
    eager = make_config(tmp_path, tiny_model_dir, engine="vllm", device="cuda", enforce_eager=True)
    assert "--enforce-eager" in server_command(create_engine(eager, tiny_model_dir)._settings, 8000)  # type: ignore[attr-defined]
    cpu = make_config(tmp_path, tiny_model_dir, engine="vllm", device="cpu")
    assert "--enforce-eager" in server_command(create_engine(cpu, tiny_model_dir)._settings, 8000)  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="GPUs for 1 replicas, not 2"):
        create_engine(config, tiny_model_dir, replica_gpus=[(0,)])
    # vLLM's share of each GPU: the plan's, unless the config sets one; else vLLM's default.
    planned = create_engine(config, tiny_model_dir, [(0,), (1,)], gpu_memory_utilization=0.61)
    assert all(r._settings.gpu_memory_utilization == 0.61 for r in planned.replicas)  # type: ignore[attr-defined]
    assert settings[0].gpu_memory_utilization == 0.9
    fixed = config.replace(gpu_memory_utilization=0.5)
    chosen = create_engine(fixed, tiny_model_dir, [(0,), (1,)], gpu_memory_utilization=0.61)
    assert all(r._settings.gpu_memory_utilization == 0.5 for r in chosen.replicas)  # type: ignore[attr-defined]


# --- a whole appliance step served by a fleet --------------------------------------------------


async def test_an_appliance_step_through_a_fleet(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """proxy -> two replicas, every rollout's calls on one of them -> one training step -> the
    new weights pushed into both; rollouts that ended are forgotten."""
    built: list[Replica] = []

    def two_replicas(config: ApplianceConfig, model_dir: Path, *placed: object) -> Engine:
        built.extend(Replica(TorchEngine(model_dir, max_batch_size=8)) for _ in range(2))
        return EngineFleet(built)

    # Replicas that record their calls (engine_replicas = 2 would build plain ones).
    monkeypatch.setattr(app_module, "create_fleet", two_replicas)
    config = make_config(tmp_path, tiny_model_dir, max_steps=1, lr=1e-2)
    async with Appliance(config) as app:
        fleet = app.engine
        assert isinstance(fleet, EngineFleet)
        assert await app.run() == "reached step 1"
        assert fleet.policy_version == 1 and [r.policy_version for r in built] == [1, 1]
        served = [r.engine._model.state_dict() for r in built]
        for name, tensor in served[0].items():
            assert torch.equal(served[1][name], tensor), name
        # Every rollout made two calls, both on the same replica; both replicas served some.
        for replica, other in (built, built[::-1]):
            rollouts = {a for a in replica.calls if a is not None}
            assert rollouts and not rollouts & set(other.calls)
            assert all(replica.calls.count(r) >= 2 for r in rollouts)
        assert all(s.rollouts == 0 for s in fleet.status())  # released as they ended


class GroupReplica(Replica):
    """A replica that can join a weight group (as a vLLM server of ``members`` workers can):
    records the ranks it was given."""

    def __init__(self, engine: TorchEngine, members: int) -> None:
        super().__init__(engine)
        self.members = members
        self.joined: list[tuple[str, int]] = []

    @property
    def in_weight_group(self) -> bool:
        return bool(self.joined)

    @property
    def weight_group_members(self) -> int:
        return self.members

    async def join_weight_group(self, spec: Mapping[str, Any], rank_offset: int = 1) -> None:
        self.joined.append((str(spec["prefix"]), rank_offset))


async def test_a_fleet_joins_a_weight_group_at_consecutive_ranks(tiny_model_dir: Path) -> None:
    """Replica i's workers take the ranks after replica i - 1's (tensor parallel 2, then 1)."""
    replicas = [GroupReplica(TorchEngine(tiny_model_dir), 2), GroupReplica(TorchEngine(tiny_model_dir), 1)]
    fleet = EngineFleet(replicas)
    assert isinstance(fleet, WeightGroupMember)
    assert fleet.weight_group_members == 3 and not fleet.in_weight_group
    await fleet.join_weight_group({"prefix": "g"})
    assert [r.joined for r in replicas] == [[("g", 1)], [("g", 3)]]
    assert fleet.in_weight_group
    # A fleet with a replica that cannot join (a torch engine) refuses.
    mixed = EngineFleet([GroupReplica(TorchEngine(tiny_model_dir), 1), Replica(TorchEngine(tiny_model_dir))])
    assert not mixed.in_weight_group
    with pytest.raises(EngineUnavailable, match="cannot join a weight group"):
        await mixed.join_weight_group({"prefix": "g"})
