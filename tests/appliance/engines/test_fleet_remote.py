"""The engine fleet with replicas that join and leave at run time (remote ones), over real torch
engines on the tiny model: behind until caught up, the staleness bound per replica, a weight
update that goes on without a replica past its deadline, removal, split placement (remote
replicas never sleep), and a call retried elsewhere or ended naming its replica. The
registration, events and HTTP routes: ``test_remote.py``; real vLLM: ``test_vllm_remote.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from appliance.engines.base import Engine, GenerateRequest, SamplingParams
from appliance.engines.fleet import EngineFleet
from appliance.engines.torch_engine import TorchEngine
from contracts.errors import EngineUnavailable
from tests.appliance.engines.contract import PROMPTS
from tests.appliance.engines.test_fleet import Replica, assert_serves, buckets_of, call, perturbed_state


@pytest_asyncio.fixture(loop_scope="function")
async def local(tiny_model_dir: Path) -> AsyncIterator[Replica]:
    replica = Replica(TorchEngine(tiny_model_dir, max_batch_size=8))
    yield replica
    await replica.close()


@pytest_asyncio.fixture(loop_scope="function")
async def remote(tiny_model_dir: Path) -> AsyncIterator[Replica]:
    replica = Replica(TorchEngine(tiny_model_dir, max_batch_size=8))
    await replica.start()
    yield replica
    await replica.close()


@pytest_asyncio.fixture(loop_scope="function")
async def fleet(local: Replica) -> AsyncIterator[EngineFleet]:
    fleet = EngineFleet([local], failure_cooldown_s=60.0, remote_deadline_s=0.5)
    await fleet.start()
    yield fleet
    await fleet.close()


def states(fleet: EngineFleet) -> dict[str, str]:
    return {status.id: status.state for status in fleet.status()}


async def test_a_joining_replica_is_behind_until_it_catches_up_then_takes_rollouts(
    fleet: EngineFleet, remote: Replica, tiny_model_dir: Path
) -> None:
    state = perturbed_state(tiny_model_dir, 1)
    await fleet.load_weights(state, 1)  # the run is at version 1; the new replica at 0
    caught: list[tuple[str, int]] = []
    fleet.on_caught_up = lambda rid, version: caught.append((rid, version))
    # Without a catch-up the fleet asks the scheduler for a push to all.
    fleet.add(remote, replica_id="rA", url="http://engine-a:8000")
    assert states(fleet) == {"0": "live", "rA": "behind"} and fleet.needs_weights
    for rollout in ("a", "b", "c"):
        await call(fleet, rollout)
    assert remote.calls == []  # behind: no rollouts

    async def catch_up(engine: Engine, version: int) -> None:
        await engine.load_weights(state, version)

    fleet.catch_up = catch_up
    fleet.catch_up_behind()
    for _ in range(100):
        if caught:
            break
        await asyncio.sleep(0.02)
    assert caught == [("rA", 1)] and states(fleet) == {"0": "live", "rA": "live"}
    assert not fleet.needs_weights
    assert_serves(remote, state)
    result = await call(fleet, "d")  # the least loaded now: the new replica
    assert fleet.replica_of("d") == 1 and remote.calls == ["d"] and result.policy_version == 1


async def test_a_catch_up_that_finds_nothing_published_asks_for_a_push_once(
    fleet: EngineFleet, remote: Replica, tiny_model_dir: Path
) -> None:
    """A replica joining a run whose version was never published (the publication is empty:
    no replica pulled before) is not caught up in a loop: it waits for the scheduler's push."""
    state = perturbed_state(tiny_model_dir, 1)
    await fleet.load_weights(state, 1)
    tries: list[int] = []

    async def nothing_published(engine: Engine, version: int) -> None:
        tries.append(version)  # a pull that finds no version: the engine keeps its own

    fleet.catch_up = nothing_published
    fleet.add(remote, replica_id="rA", url="http://engine-a:8000")
    await asyncio.sleep(0.2)
    assert tries == [1] and states(fleet)["rA"] == "behind" and fleet.needs_weights
    await fleet.load_weights(state, 1)  # the scheduler's push to all
    assert states(fleet) == {"0": "live", "rA": "live"} and not fleet.needs_weights
    assert_serves(remote, state)


async def test_the_staleness_bound_applies_per_replica(
    fleet: EngineFleet, remote: Replica, tiny_model_dir: Path
) -> None:
    fleet.max_staleness = 1
    fleet.add(remote, replica_id="rA", url="http://engine-a:8000")
    state = perturbed_state(tiny_model_dir, 2)
    await fleet.load_weights(state, 1)  # both take it: the new one is caught up by the push
    assert states(fleet) == {"0": "live", "rA": "live"}
    # Version 2 reaches the local replica alone: the remote one is 1 behind, within the bound.
    await fleet.replicas[0].load_weights(state, 2)
    fleet._version = 2  # what a push that the remote replica missed leaves (without marking it)
    assert states(fleet)["rA"] == "live"
    await call(fleet, "a")
    await call(fleet, "b")
    assert {fleet.replica_of("a"), fleet.replica_of("b")} == {0, 1}
    result_b = await call(fleet, "b")
    assert result_b.policy_version == (1 if fleet.replica_of("b") == 1 else 2)  # each token its sampler's
    # Two behind: past the bound, no new rollouts, and its rollout moves.
    await fleet.replicas[0].load_weights(state, 3)
    fleet._version = 3
    assert states(fleet)["rA"] == "stale"
    pinned = "a" if fleet.replica_of("a") == 1 else "b"
    await call(fleet, pinned)
    await call(fleet, "c")
    assert fleet.replica_of(pinned) == 0 and fleet.replica_of("c") == 0


async def test_an_update_goes_on_without_a_remote_replica_past_its_deadline(
    fleet: EngineFleet, local: Replica, remote: Replica, tiny_model_dir: Path
) -> None:
    fleet.add(remote, replica_id="rA", url="http://engine-a:8000")
    failed: list[str] = []
    fleet.on_failed = lambda rid, error: failed.append(f"{rid}: {error}")
    remote.bucket_delay_s = 5.0  # each bucket 5 s: the whole push would take minutes
    state = perturbed_state(tiny_model_dir, 3)
    started = time.monotonic()
    await fleet.load_weight_buckets(buckets_of(state, []), 1)
    assert time.monotonic() - started < 3.0  # the 0.5 s deadline, not the slow replica, set the pace
    assert fleet.policy_version == 1 and local.policy_version == 1
    assert_serves(local, state)
    assert states(fleet) == {"0": "live", "rA": "behind"}
    assert failed and failed[0].startswith("rA: it did not take the weight update within 0.5 s")
    # The next update it keeps up with catches it up.
    remote.bucket_delay_s = 0.0
    await asyncio.sleep(5.5)  # its dropped load has ended (with the error it was handed)
    await fleet.load_weight_buckets(buckets_of(state, []), 2)
    assert states(fleet) == {"0": "live", "rA": "live"} and remote.policy_version == 2
    assert_serves(remote, state)


async def test_a_remote_replica_never_sleeps_and_leaves_with_its_rollouts_moving(
    fleet: EngineFleet, local: Replica, remote: Replica
) -> None:
    fleet.add(remote, replica_id="rA", url="http://engine-a:8000")
    fleet._replicas[1].behind = False  # as after a catch-up (both serve the checkpoint's version)
    await call(fleet, "a")
    await call(fleet, "b")
    assert (fleet.replica_of("a"), fleet.replica_of("b")) == (0, 1)
    await fleet.sleep(1)
    assert local.is_sleeping and not remote.is_sleeping and fleet.is_sleeping
    # Split placement: the remote replica serves on while the local one sleeps for a step.
    await call(fleet, "b")
    await call(fleet, "a")
    assert fleet.replica_of("a") == 1 and remote.calls == ["b", "b", "a"]
    await fleet.wake()
    engine = fleet.remove("rA")
    assert engine is remote and [s.id for s in fleet.status()] == ["0"]
    await call(fleet, "b")
    assert fleet.replica_of("b") == 0
    with pytest.raises(ValueError, match="launched by the appliance"):
        fleet.remove("0")


async def test_a_call_that_failed_before_any_token_is_served_elsewhere_one_after_names_the_replica(
    fleet: EngineFleet, local: Replica, remote: Replica
) -> None:
    fleet.add(remote, replica_id="rA", url="http://engine-a:8000")
    fleet._replicas[1].behind = False
    await call(fleet, "a")
    await call(fleet, "b")
    assert fleet.replica_of("b") == 1
    remote.broken = True
    result = await call(fleet, "b")  # no token came: tried again on the local replica
    assert result.token_ids and fleet.replica_of("b") == 0
    remote.broken = False
    fleet._replicas[1].failed_at = None

    class DiesMidStream:
        """The remote replica's engine, cut off after its third token."""

        def __getattr__(self, name: str) -> object:
            return getattr(remote, name)

        async def generate(self, request: GenerateRequest) -> object:
            assert request.on_token is not None
            for token in (5, 6, 7):
                request.on_token(token, -0.5)
            raise EngineUnavailable("the vLLM server broke off /v1/completions: connection reset")

    fleet._replicas[1].engine = DiesMidStream()  # type: ignore[assignment]
    seen: list[int] = []
    request = GenerateRequest(
        prompt_ids=PROMPTS[2],
        params=SamplingParams(max_tokens=8, temperature=1.0, seed=0),
        affinity="c",
        on_token=lambda token, logprob: seen.append(token),
    )
    fleet._assign("c", fleet._replicas[1])
    with pytest.raises(
        EngineUnavailable, match=r"replica rA \(http://engine-a:8000\) was lost mid-call, after it sampled 3"
    ):
        await fleet.generate(request)
    assert seen == [5, 6, 7]  # nothing sampled twice: the call ended where the replica did
