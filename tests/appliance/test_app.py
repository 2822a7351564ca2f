"""The whole appliance in process: real store, engine, proxy, openai client, trainer."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.app import Appliance
from appliance.chat.render import GENERATION_PROMPT
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.operations.collector import GC_YOUNG_THRESHOLD
from contracts.errors import BadRequest
from store.events import LLMCallCompleted, PolicyVersionPublished, RewardReported, TrainStepCompleted
from store.eventstore import EventStore
from store.projections import RunState
from tests.support import make_config
from trainer.buckets import WeightBucket
from trainer.samples import build_samples


@pytest.fixture
async def appliance(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=2)) as app:
        yield app


async def wait_finished(app: Appliance, rollouts: int) -> None:
    async with asyncio.timeout(60):
        while sum(1 for v in app.live.state.rollouts.values() if v.status != "running") < rollouts:
            await app.live.wait_change(app.live.position)


async def test_once_started_the_process_collects_its_young_objects_less_often(appliance: Appliance) -> None:
    assert gc.get_freeze_count() > 0  # what was there at the start is out of the collector's sight
    assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD


async def test_runs_steps_and_records_everything(appliance: Appliance) -> None:
    reason = await appliance.run()
    assert reason == "reached step 2"
    assert appliance.engine.policy_version == 2
    events = [s.event for s in await appliance.store.read()]
    steps = [e for e in events if isinstance(e, TrainStepCompleted)]
    versions = [e.policy_version for e in events if isinstance(e, PolicyVersionPublished)]
    assert [s.step for s in steps] == [1, 2]
    assert versions == [1, 2]
    trained = [r for s in steps for r in s.rollouts]
    assert len(trained) == len(set(trained)) == 2 * 2 * 2  # steps x groups x group size
    state = appliance.live.state
    for rollout in trained:
        view = state.rollouts[rollout]
        assert view.status == "finished"
        assert view.reward is not None
        # Trained on: the live state keeps the count, the log the calls.
        assert (view.call_count, view.calls, view.released) == (2, [], True)
        calls = [e for e in events if isinstance(e, LLMCallCompleted) and e.rollout == rollout]
        assert len(calls) == 2 and all(call.prompt_ids and call.response_ids for call in calls)
        assert view.tokens_sampled == sum(len(call.response_ids) for call in calls)
    rewards = [e for e in events if isinstance(e, RewardReported)]
    assert {e.rollout for e in rewards} == set(trained)


async def test_merged_sample_is_exactly_what_was_sampled_plus_rendered(appliance: Appliance) -> None:
    seen: list[tuple[list[int], GenerateResult]] = []
    real_generate = appliance.engine.generate

    async def spy(request: GenerateRequest) -> GenerateResult:
        result = await real_generate(request)
        seen.append((list(request.prompt_ids), result))
        return result

    appliance.engine.generate = spy  # type: ignore[method-assign]
    await appliance.controller.start_group(1)
    await wait_finished(appliance, 1)

    (view,) = appliance.live.state.rollouts.values()
    assert view.status == "finished", view.error
    calls = [
        s.event
        for s in await appliance.store.read(rollout=view.rollout)
        if isinstance(s.event, LLMCallCompleted)
    ]
    assert len(calls) == len(seen) == 2
    (sample,) = build_samples(calls)

    (p1, r1), (p2, r2) = seen
    first_turn = p1 + list(r1.token_ids)
    assert p2[: len(first_turn)] == first_turn, "the second prompt must extend the first call exactly"
    between = p2[len(first_turn) :]
    assert list(sample.tokens) == first_turn + between + list(r2.token_ids)
    sampled = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
    assert sampled == list(r1.token_ids) + list(r2.token_ids)
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m] == pytest.approx(
        list(r1.logprobs) + list(r2.logprobs), abs=1e-6
    )

    # What lies between the two sampled turns is the proxy's own rendering: the turn's closing
    # tokens, the harness's next message, and the generation prompt.
    tokenizer = appliance.registry._tokenizer
    im_end = tokenizer.im_end_id
    closing = ([] if r1.token_ids[-1] == im_end else [im_end]) + tokenizer.encode("\n")
    assert between[: len(closing)] == closing
    assert between[-len(tokenizer.encode(GENERATION_PROMPT)) :] == tokenizer.encode(GENERATION_PROMPT)


async def test_restart_resumes_from_stored_version(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=1)) as app:
        await app.run()
        trained = {k: v.clone() for k, v in app.training.trainer.state_dict_for_engine().items()}
    monkeypatch.setattr("appliance.app.REPLAY_PAGE", 3)  # the log folded over many pages
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=2)) as app:
        await app.live.wait_for(app.store.last_position)
        whole = await app.store.read()
        assert len(whole) > 10 * 3
        assert app.live.state == RunState.from_events(whole)
        assert app.engine.policy_version == 1
        restored = app.training.trainer.state_dict_for_engine()
        assert all((restored[k] == v).all() for k, v in trained.items())
        assert await app.run() == "reached step 2"
        assert app.engine.policy_version == 2
    store = await EventStore.open(tmp_path / "run" / "events.sqlite", readonly=True)
    try:
        steps = [s.event for s in await store.read(types={"TrainStepCompleted"})]
    finally:
        await store.close()
    assert [s.step for s in steps if isinstance(s, TrainStepCompleted)] == [1, 2]


@pytest.mark.parametrize("options", [{"trainer": "verl"}, {"advantage": "rloo", "normalization": "token"}])
async def test_trainer_options_run_end_to_end(
    tmp_path: Path, tiny_model_dir: Path, options: dict[str, str]
) -> None:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=1, **options)) as app:
        assert await app.run() == "reached step 1"
        assert app.engine.policy_version == 1
        (step,) = app.live.state.steps
        assert step.samples > 0
        assert all(v == v for v in step.metrics.values())  # no NaN


async def test_an_engine_that_lost_its_weights_gets_them_pushed_again(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=1)) as app:

        async def cut_short() -> AsyncIterator[WeightBucket]:
            buckets = app.training.trainer.weight_buckets(4096)
            try:
                yield next(buckets)  # the stream ends without its last bucket
            finally:
                buckets.close()  # type: ignore[attr-defined]

        with pytest.raises(BadRequest):
            await app.engine.load_weight_buckets(cut_short(), 0)
        assert app.engine.needs_weights  # it serves nothing rather than a mix of two versions
        async with asyncio.timeout(120):  # without the new push no rollout could ever finish
            assert await app.run() == "reached step 1"
        assert not app.engine.needs_weights and app.engine.policy_version == 1
        engine: Any = app.engine.replicas[0]  # the fleet's only replica
        served = engine._model.state_dict()
        for name, tensor in app.training.trainer.state_dict_for_engine().items():
            assert torch.equal(served[name], tensor), name


async def test_collocated_on_gpus_the_trainer_loads_while_the_engine_sleeps(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started awake at its fraction with the trainer built beside it, vLLM and the trainer's
    fp32 weights overcommit a collocated GPU. With a collocated GPU plan (the CPU standing in
    for the GPU) the engine sleeps while the trainer is built and restored, and wakes only once
    the trainer has offloaded; the restored version is pushed after that."""
    from appliance.engines.torch_engine import TorchEngine
    from appliance.operations import preflight
    from appliance.placement.memory_model import ModelSpec
    from appliance.placement.plan import Machine, PlacementSettings, plan
    from appliance.training.service import TrainingService
    from trainer.policy import PolicyTrainer

    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=1)) as app:
        await app.run()  # version 1, which the next start restores

    gpu_plan = plan(
        Machine.described(1, 80 * 1024**3, 64 * 1024**3),
        ModelSpec(params=10**6),
        PlacementSettings(engine="torch", trainer_ranks=1),
        device="cuda",
    )
    assert gpu_plan.fits and gpu_plan.placement == "collocated"
    monkeypatch.setattr(preflight, "check", lambda config: gpu_plan)
    calls: list[str] = []

    def record(cls: Any, name: str) -> None:
        real = getattr(cls, name)
        if asyncio.iscoroutinefunction(real):

            async def wrapped_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                calls.append(f"{name} {args[0] if args else ''}".strip())
                return await real(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, wrapped_async)
        else:

            def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
                calls.append(name)
                return real(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, wrapped)

    for name in ("start", "sleep", "wake"):
        record(TorchEngine, name)
    for name in ("__init__", "load", "offload"):
        record(PolicyTrainer, name)
    record(TrainingService, "push")
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=1)) as app:
        assert app.engine.policy_version == 1
        assert not app.engine.is_sleeping
        started = len(calls)
        assert await app.run() == "reached step 1"
        # The shutdown checkpoint brings the trainer's state back to the GPU: the engine sleeps.
        assert calls[started:] == ["sleep 1"]
    assert calls[:7] == [
        "start",
        "sleep 1",
        "__init__",
        "load",
        "offload",
        "wake ('weights', 'kv_cache')",  # through the engine fleet, which names the tags
        "push 1",
    ]
