"""The live scheduler: async switches with partial rollouts, and the recorded switch phases."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import orjson
import pytest
from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.engines.base import GenerateRequest, GenerateResult
from store.events import LLMCallCompleted, SwitchPhaseCompleted, TrainStepCompleted
from tests.support import make_config


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    config = make_config(tmp_path, tiny_model_dir, mode="async", eta=1, group_size=2, batch_groups=1)
    async with Appliance(config) as appliance:
        yield appliance


async def test_call_in_flight_at_a_switch_finishes_with_two_policy_versions(app: Appliance) -> None:
    assert app.runner is not None
    group = await app.controller.start_group(2)
    async with asyncio.timeout(60):
        while len(app.live.state.ready_groups()) < 1:
            await app.live.wait_change(app.live.position)

    long = app.registry.register("long", task_id="t", group="other", task={})
    requests: list[GenerateRequest] = []
    real_generate = app.engine.generate

    async def generate(request: GenerateRequest) -> GenerateResult:
        if request.affinity == "long":
            requests.append(request)
        return await real_generate(request)

    app.engine.generate = generate  # type: ignore[method-assign]
    async with AsyncOpenAI(
        base_url=f"{app.proxy_url}/rollouts/long/v1", api_key=long.token, max_retries=0
    ) as oai:
        stream = await oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=1500,
            stream=True,
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                # Generation is under way: switch to training now, as async mode does.
                await app.runner._switch((group,))
        # The harness saw an ordinary, complete stream.
        assert chunks[-1].choices and chunks[-1].choices[0].finish_reason in ("stop", "length")

    calls = [s.event for s in await app.store.read(rollout="long") if isinstance(s.event, LLMCallCompleted)]
    (call,) = calls
    assert call.preemptions == 1
    assert set(call.response_versions) == {0, 1}
    assert list(call.response_versions) == sorted(call.response_versions)
    assert len(call.response_versions) == len(call.response_ids) == len(call.response_logprobs)
    assert call.policy_version == 0
    # The rendered prompt goes with its JSON; the continuation's prompt (with what was sampled
    # before the switch) is another, so it goes without.
    first, continued = requests
    assert first.prompt_json == orjson.dumps(list(first.prompt_ids))
    assert list(continued.prompt_ids[: len(first.prompt_ids)]) == list(first.prompt_ids)
    assert len(continued.prompt_ids) > len(first.prompt_ids) and continued.prompt_json is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == call.response_text

    events = [s.event for s in await app.store.read()]
    phases = [e.phase for e in events if isinstance(e, SwitchPhaseCompleted)]
    collocates = hasattr(app.training.trainer, "onload")
    moves = (["onload"], ["offload"]) if collocates else ([], [])
    assert phases == [
        "drain",
        "sleep",
        *moves[0],
        "train",
        *moves[1],
        "wake_weights",
        "push",
        "wake_kv_cache",
    ]
    assert all(e.duration_s >= 0 for e in events if isinstance(e, SwitchPhaseCompleted))
    (step,) = [e for e in events if isinstance(e, TrainStepCompleted)]
    assert step.metrics["stale_tokens_dropped"] == 0
    assert app.engine.policy_version == 1


async def test_async_run_reaches_its_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, mode="async", eta=1, max_steps=3, batch_groups=1)
    async with Appliance(config) as app:
        assert await app.run() == "reached step 3"
        state = app.live.state
        assert app.engine.policy_version == 3
        # Rollouts were admitted ahead of training, within the staleness bound.
        for view in state.rollouts.values():
            if view.trained_step is not None:
                assert view.trained_step - 1 - view.created_version <= config.scheduler.eta


async def test_engine_failure_during_a_switch_is_recovered(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=2, batch_groups=1)
    async with Appliance(config) as app:
        real_wake = app.engine.wake
        failures: list[list[str]] = []

        async def flaky_wake(tags: Sequence[str] = ("weights", "kv_cache")) -> None:
            if not failures:
                failures.append(list(tags))
                raise RuntimeError("wake failed")
            await real_wake(tags)

        app.engine.wake = flaky_wake  # type: ignore[method-assign]
        assert await app.run() == "reached step 2"
        assert failures == [["weights"]]
        # The failed switch's weights were pushed by the restart, then step 2 pushed its own.
        assert app.engine.policy_version == 2
        assert not app.engine.is_sleeping


@pytest.mark.parametrize("shares_gpu", [False, True])
async def test_a_checkpoint_between_steps_is_written_while_a_collocated_engine_sleeps(
    tmp_path: Path, tiny_model_dir: Path, shares_gpu: bool
) -> None:
    """A checkpoint brings an offloaded trainer's state back to its device for the write: where
    the trainer shares the engine's GPUs the engine sleeps meanwhile (it would overcommit them
    otherwise), and serves again afterwards; elsewhere the engine is left alone."""
    from store.events import CheckpointSaved

    async with Appliance(make_config(tmp_path, tiny_model_dir, batch_groups=1)) as app:
        assert app.runner is not None
        app.runner.trainer_shares_gpu = shares_gpu
        calls: list[str] = []
        engine, trainer = app.engine, app.training.trainer
        real_sleep, real_wake, real_save = engine.sleep, engine.wake, trainer.save

        async def sleep(level: int = 1) -> None:
            calls.append(f"sleep {level}")
            await real_sleep(level)

        async def wake(tags: Sequence[str] = ("weights", "kv_cache")) -> None:
            calls.append("wake " + ",".join(tags))
            await real_wake(tags)

        def save(*args: object, **kwargs: object) -> Path:
            calls.append("save asleep" if engine.is_sleeping else "save awake")
            return real_save(*args, **kwargs)  # type: ignore[arg-type]

        engine.sleep = sleep  # type: ignore[method-assign]
        engine.wake = wake  # type: ignore[method-assign]
        trainer.save = save  # type: ignore[method-assign]
        await app.runner._checkpoint("requested")

        expected = (
            ["sleep 1", "save asleep", "wake weights", "wake kv_cache"] if shares_gpu else ["save awake"]
        )
        assert calls == expected
        assert not engine.is_sleeping
        saved = [s.event for s in await app.store.read() if isinstance(s.event, CheckpointSaved)]
        assert [e.reason for e in saved] == ["requested"]
        assert app.runner.gate.is_open
