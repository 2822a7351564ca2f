"""Run control over HTTP against a real appliance: pause, resume, checkpoint, stop.

Every request goes through ``POST /admin/control`` with a real aiohttp client; what the
scheduler did is read back from the event log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from appliance.app import Appliance
from appliance.scheduler.decide import decide
from store.events import (
    CheckpointSaved,
    ControlRequested,
    Event,
    ModelExported,
    RolloutCreated,
    TrainStepCompleted,
)
from tests.support import make_config


async def control(app: Appliance, action: str, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token or app.admin_token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{app.proxy_url}/admin/control", json={"action": action}, headers=headers) as response,
    ):
        return response.status, await response.json()


async def admin_status(app: Appliance) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {app.admin_token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{app.proxy_url}/admin/status", headers=headers) as response,
    ):
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def events(app: Appliance) -> list[Event]:
    return [s.event for s in await app.store.read()]


async def wait_for_event(app: Appliance, kind: type[Event]) -> None:
    async with asyncio.timeout(120):
        while not any(isinstance(e, kind) for e in await events(app)):
            await app.live.wait_change(app.live.position)


async def test_control_is_durable_before_the_answer_and_checks_its_input(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
        status, body = await control(app, "pause")
        assert status == 202
        assert body["action"] == "pause"
        (stored,) = await app.store.read(after=body["position"] - 1, types={"ControlRequested"})
        assert stored.position == body["position"]
        assert stored.event == ControlRequested(ts=stored.event.ts, action="pause", source="admin")
        await app.live.wait_for(body["position"])
        assert (await admin_status(app))["paused"] is True

        status, body = await control(app, "rewind")
        assert status == 400
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"] == "action"
        status, body = await control(app, "stop", token="not-the-admin-token")
        assert status == 401
        assert "error" in body
        kinds = [e.action for e in await events(app) if isinstance(e, ControlRequested)]
        assert kinds == ["pause"], "refused requests record nothing"

        await control(app, "resume")
        await app.live.wait_for(app.store.last_position)
        assert (await admin_status(app))["paused"] is False


async def test_pause_holds_admissions_and_steps_until_resume(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=1, batch_groups=1)
    async with Appliance(config) as app:
        await control(app, "pause")
        await control(app, "checkpoint")
        run = asyncio.create_task(app.run())
        # The runner answers the checkpoint request while paused: it has seen the pause, and
        # started nothing.
        await wait_for_event(app, CheckpointSaved)
        log = await events(app)
        (saved,) = [e for e in log if isinstance(e, CheckpointSaved)]
        assert (saved.reason, saved.step, saved.policy_version) == ("requested", 0, 0)
        assert (tmp_path / "run" / saved.path).is_file()
        assert not any(isinstance(e, RolloutCreated | TrainStepCompleted) for e in log)
        assert decide(app.runner.policy, app.runner.observation()) == []  # type: ignore[union-attr]
        assert not run.done()

        await control(app, "resume")
        async with asyncio.timeout(120):
            assert await run == "reached step 1"
        log = await events(app)
        assert [e.step for e in log if isinstance(e, TrainStepCompleted)] == [1]
        reasons = [e.reason for e in log if isinstance(e, CheckpointSaved)]
        assert reasons == ["requested", "shutdown"]


async def test_a_restart_while_paused_stays_paused(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=1)
    async with Appliance(config) as app:
        await control(app, "pause")
    async with Appliance(config) as again:
        assert again.live.state.paused
        observation = again.runner.observation()  # type: ignore[union-attr]
        assert observation.paused
        assert decide(again.runner.policy, observation) == []  # type: ignore[union-attr]
        assert (await admin_status(again))["paused"] is True


async def test_stop_finishes_the_step_then_checkpoints_and_exports(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=None, batch_groups=1)
    stops: list[asyncio.Task[tuple[int, dict[str, Any]]]] = []
    app = Appliance(
        config, on_step=lambda step, state: stops.append(asyncio.create_task(control(app, "stop")))
    )
    async with app:
        async with asyncio.timeout(180):
            reason = await app.run()
        assert reason == "stop requested"
        assert stops and (await stops[0])[0] == 202
        log = await events(app)
        steps = [e.step for e in log if isinstance(e, TrainStepCompleted)]
        assert steps and steps == list(range(1, len(steps) + 1))
        (shutdown,) = [e for e in log if isinstance(e, CheckpointSaved) and e.reason == "shutdown"]
        assert (shutdown.step, shutdown.policy_version) == (steps[-1], app.live.state.policy_version)
        (exported,) = [e for e in log if isinstance(e, ModelExported)]
        assert exported.step == steps[-1]
        assert (Path(exported.path) / "config.json").is_file()
        assert Path(exported.path) == (tmp_path / "run" / "export").resolve()
