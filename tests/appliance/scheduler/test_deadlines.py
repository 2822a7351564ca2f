"""Bounded waits of the scheduler, on a real appliance: the drain before a step has a deadline,
a phase past its deadline is recorded and reported by ``/healthz``, and a stop is forced when it
takes longer than ``stop_timeout_s``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.engines.base import GenerateRequest, GenerateResult
from store.events import ApplianceStopped, LLMCallCompleted, PhaseOverran, TrainStepCompleted
from tests.support import make_config
from trainer.items import StepOutput, TrainItem

STUCK_SEED = 4242


async def test_a_call_that_never_ends_cannot_hold_the_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The reported wedge: a generation the engine never answers kept the drain (and with it the
    step and every later call) waiting forever. Now it is preempted at the drain's deadline, the
    step goes on, and the call continues after it."""
    config = make_config(tmp_path, tiny_model_dir, max_steps=1, batch_groups=1, drain_timeout_s=0.5)
    async with Appliance(config) as app:
        real_generate = app.engine.generate
        stuck = asyncio.Event()
        hung_once = False

        async def generate(request: GenerateRequest) -> GenerateResult:
            nonlocal hung_once
            if request.params.seed == STUCK_SEED and not hung_once:
                hung_once = True
                stuck.set()
                await asyncio.Event().wait()  # lost: only a cancellation ends it
            return await real_generate(request)

        app.engine.generate = generate  # type: ignore[method-assign]
        client = AsyncOpenAI(base_url=app.proxy_url + "/v1", api_key=app.admin_token, max_retries=0)
        call = asyncio.ensure_future(
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], seed=STUCK_SEED, max_tokens=4
            )
        )
        await asyncio.wait_for(stuck.wait(), 30)
        reason = await asyncio.wait_for(app.run(), 120)
        assert reason == "reached step 1"
        answer = await asyncio.wait_for(call, 30)
        assert answer.choices[0].finish_reason in ("stop", "length")
        events = [s.event for s in await app.store.read()]
        (overran,) = [e for e in events if isinstance(e, PhaseOverran)]
        assert overran.phase == "drain" and overran.step == 1 and overran.preempted == 1
        assert overran.deadline_s == 0.5
        assert [e.step for e in events if isinstance(e, TrainStepCompleted)] == [1]
        (recorded,) = [e for e in events if isinstance(e, LLMCallCompleted) and e.rollout == "default"]
        assert recorded.preemptions == 1
        assert app.runner is not None and app.runner.gate.inflight == 0
        await client.close()


def _slow_step(app: Appliance, seconds: float, release: threading.Event | None = None) -> threading.Event:
    """Make every trainer step take ``seconds`` (or wait for ``release``); returns an event set
    when the first step starts."""
    trainer: Any = app.training.trainer
    real_step = trainer.step
    starts = threading.Event()

    def step(items: Sequence[TrainItem]) -> StepOutput:
        starts.set()
        if release is not None:
            release.wait(120)
        else:
            time.sleep(seconds)
        return real_step(items)  # type: ignore[no-any-return]

    trainer.step = step
    return starts


async def _health(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(url + "/healthz") as response:
        return response.status, await response.json()


async def test_a_phase_past_its_deadline_is_an_event_and_unhealthy_until_it_ends(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=1, batch_groups=1, phase_timeout_s=0.3)
    async with Appliance(config) as app, aiohttp.ClientSession() as session:
        starts = _slow_step(app, 2.0)
        assert await _health(session, app.proxy_url) == (200, {"status": "ok", "rollouts": 0})
        run = asyncio.ensure_future(app.run())
        seen: tuple[int, dict[str, Any]] | None = None
        async with asyncio.timeout(60):
            while seen is None:
                status, body = await _health(session, app.proxy_url)
                if status == 503:
                    seen = status, body
                await asyncio.sleep(0.05)
        assert starts.is_set(), "unhealthy before the step started"
        assert any("train phase of step 1" in reason for reason in seen[1]["reasons"]), seen
        assert seen[1]["status"] == "unhealthy"
        assert await asyncio.wait_for(run, 60) == "reached step 1"
        status, body = await _health(session, app.proxy_url)
        assert status == 200 and body["status"] == "ok"
        events = [s.event for s in await app.store.read()]
        overran = [e for e in events if isinstance(e, PhaseOverran)]
        assert [(e.phase, e.step, e.deadline_s) for e in overran] == [("train", 1, 0.3)]


async def test_a_stop_that_takes_too_long_is_forced_and_the_step_abandoned(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=3, batch_groups=1, stop_timeout_s=0.5)
    release = threading.Event()
    try:
        async with Appliance(config) as app:
            starts = _slow_step(app, 0, release)
            run = asyncio.ensure_future(app.run())
            assert await asyncio.to_thread(starts.wait, 60)
            assert "training step 1: train" in app.activity()
            app.request_stop()
            asked = time.monotonic()
            reason = await asyncio.wait_for(run, 30)
            assert time.monotonic() - asked < 0.5 + 2.0
            assert reason.startswith("stop forced: it did not end within 0.5 s")
            assert "training step 1: train" in reason
            assert app.forced is not None
        events = [s.event for s in await _read(config.db_path)]
        assert not [e for e in events if isinstance(e, TrainStepCompleted)]
        stopped = [e for e in events if isinstance(e, ApplianceStopped)]
        assert stopped and stopped[-1].reason == reason
    finally:
        release.set()


async def test_a_stop_within_its_bound_is_not_forced(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=3, batch_groups=1, stop_timeout_s=30)
    async with Appliance(config) as app:
        starts = _slow_step(app, 0.5)
        run = asyncio.ensure_future(app.run())
        assert await asyncio.to_thread(starts.wait, 60)
        app.request_stop()
        assert await asyncio.wait_for(run, 30) == "stop requested"
        assert app.forced is None
        assert app.live.state.step == 1, "the step under way finishes within the bound"


async def _read(db: Path) -> list[Any]:
    from store.eventstore import read_events_sync

    return await asyncio.to_thread(read_events_sync, db)
