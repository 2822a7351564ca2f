"""External runners: rollouts claimed, run and ended over HTTP by harnesses the appliance did not
start (the ``external`` adapter, ``appliance.rollouts.external``, ``appliance.proxy.runners``,
``harness_adapters.runner``), against a real appliance with the tiny model."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI, OpenAI

from appliance.app import Appliance
from appliance.config import ApplianceConfig, load_config
from harness_adapters import runner
from harness_adapters.external import ExternalAdapter
from harness_adapters.registry import load_adapter
from store.events import RewardReported, RolloutCreated, RolloutFinished, TrainStepCompleted
from store.eventstore import EventStore
from tests.support import make_config

ROOT = Path(__file__).resolve().parents[3]


def external_config(tmp_path: Path, model_dir: Path, **overrides: object) -> ApplianceConfig:
    values: dict[str, object] = {"adapter": "external", "runner_claim_wait_s": 5.0}
    values.update(overrides)
    return make_config(tmp_path, model_dir, **values)


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(external_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


async def post(
    app: Appliance, path: str, body: dict[str, Any] | None, token: str
) -> tuple[int, dict[str, Any], str]:
    """Status, JSON body and Retry-After of one POST to the proxy."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(app.proxy_url + path, json=body, headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        return r.status, await r.json(), r.headers.get("Retry-After", "")


async def events_of(app: Appliance, rollout: str) -> list[object]:
    return [s.event for s in await app.store.read(rollout=rollout)]


async def ended(app: Appliance, rollout: str) -> RolloutFinished:
    async with asyncio.timeout(20):
        while True:
            for event in await events_of(app, rollout):
                if isinstance(event, RolloutFinished):
                    return event
            await app.live.wait_change(app.live.position)


# --- config -----------------------------------------------------------------------------------


def test_the_external_adapter_is_chosen_from_toml_and_the_environment(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[adapter]\nadapter = "external"\n\n[harness]\nrunner_lease_s = 42\n')
    from_file = load_config(toml, env={})
    assert from_file.harness.adapter_spec() == {"adapter": "external"}
    assert from_file.harness.runner_lease_s == 42.0
    from_env = load_config(env={"APPLIANCE_ADAPTER": "external", "APPLIANCE_RUNNER_CLAIM_WAIT_S": "7"})
    assert from_env.harness.adapter_spec() == {"adapter": "external"}
    assert from_env.harness.runner_claim_wait_s == 7.0
    json_env = load_config(env={"APPLIANCE_ADAPTER": '{"adapter": "external"}'})
    assert json_env.harness.adapter_spec() == {"adapter": "external"}
    assert isinstance(load_adapter(from_env.harness.adapter_spec()), ExternalAdapter)


# --- claim, model calls, heartbeat, reward, finish --------------------------------------------


async def test_a_claimed_rollout_is_called_rewarded_and_finished_over_http(app: Appliance) -> None:
    group = await app.controller.start_group(2)
    claim = await runner.claim(app.proxy_url, app.admin_token)
    assert claim.rollout_id == f"{group}-r0"  # the oldest offer first
    assert claim.base_url == f"{app.proxy_url}/rollouts/{claim.rollout_id}/v1"
    assert claim.model == app.model_name
    created = next(e for e in await events_of(app, claim.rollout_id) if isinstance(e, RolloutCreated))
    assert created.adapter == "external"
    assert claim.task == created.task and claim.task_id == created.task_id

    oai = AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0)
    reply = await oai.chat.completions.create(
        model=claim.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    await runner.heartbeat(claim)
    await runner.report_reward(claim, 0.75)
    await runner.finish(claim)  # returns once the end is recorded
    finished = [e for e in await events_of(app, claim.rollout_id) if isinstance(e, RolloutFinished)]
    assert [(e.status, e.error) for e in finished] == [("finished", "")]
    view = app.live.state.rollouts[claim.rollout_id]
    assert view.reward == 0.75 and len(view.calls) == 1

    with pytest.raises(runner.RunnerError) as again:
        await runner.finish(claim)
    assert again.value.status == 409 and "already ended (finished)" in again.value.message

    other = await runner.claim(app.proxy_url, app.admin_token)
    assert other.rollout_id == f"{group}-r1"
    await runner.finish(other, "failed", "the sandbox broke")
    failed = await ended(app, other.rollout_id)
    assert failed.status == "failed"
    assert "its external runner failed it: the sandbox broke" in failed.error


async def test_a_claim_with_a_task_gets_a_group_on_it_ahead_of_the_task_set(app: Appliance) -> None:
    task = {"id": "mine-1", "question": "What is 2 + 2?", "answer": 4}
    claiming = asyncio.create_task(runner.claim(app.proxy_url, app.admin_token, task))
    async with asyncio.timeout(5):
        while app.runners is None or not app.runners.queued:  # noqa: ASYNC110 (another client's request)
            await asyncio.sleep(0.01)
    group = await app.controller.start_group(2)  # what the scheduler does next
    claim = await claiming
    assert claim.task == task and claim.task_id == "mine-1"
    assert claim.rollout_id.startswith(group)
    # The group's other rollout is claimable with an empty body.
    second = await runner.claim(app.proxy_url, app.admin_token)
    assert second.rollout_id.startswith(group) and second.rollout_id != claim.rollout_id
    assert second.task == task
    # The task set goes on where it was.
    next_group = await app.controller.start_group(1)
    created = [e for e in await app.store.read(types={"RolloutCreated"})]
    tasks = {s.event.group: s.event.task_id for s in created if isinstance(s.event, RolloutCreated)}
    assert tasks[group] == "mine-1" and tasks[next_group].startswith("add-")


async def test_a_claim_nothing_answers_is_a_503_with_retry_after_and_leaves_nothing(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = external_config(tmp_path, tiny_model_dir, runner_claim_wait_s=0.2)
    async with Appliance(config) as app:
        status, body, retry = await post(app, "/admin/rollouts", {}, app.admin_token)
        assert status == 503 and retry
        assert body["error"]["code"] == "no_rollout_offered"
        assert "no rollout was offered within 0.2 s" in body["error"]["message"]

        task = {"id": "withdrawn", "question": "What is 1 + 1?"}
        status, body, retry = await post(app, "/admin/rollouts", {"task": task}, app.admin_token)
        assert status == 503 and retry
        assert "the task was withdrawn" in body["error"]["message"]
        assert await app.store.read(types={"RolloutCreated"}) == []
        # The withdrawn task is not drawn later; an offer made now is claimed at once.
        group = await app.controller.start_group(1)
        claim = await runner.claim(app.proxy_url, app.admin_token)
        assert claim.rollout_id == f"{group}-r0" and claim.task_id != "withdrawn"
        await runner.finish(claim)


async def test_a_runners_task_goes_ahead_of_a_group_nobody_claimed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = external_config(
        tmp_path, tiny_model_dir, group_size=2, batch_groups=1, max_steps=2, runner_claim_wait_s=10.0
    )
    async with Appliance(config) as app:
        board = app.runners
        assert board is not None
        run = asyncio.create_task(app.run())
        async with asyncio.timeout(20):
            while board.offered < 2:  # noqa: ASYNC110 (the scheduler offers the batch's one group)
                await asyncio.sleep(0.02)
        (unclaimed,) = {view.group for view in app.live.state.rollouts.values()}
        set_task = app.live.state.rollouts[f"{unclaimed}-r0"].task_id

        # The batch is full of a group nobody claimed: a runner's task goes ahead of it at once
        # (it used to wait runner_claim_wait_s and get a 503 blaming training or a pause).
        task = {"id": "mine-1", "question": "What is 2 + 2?", "answer": 4}
        started = time.monotonic()
        mine = await runner.claim(app.proxy_url, app.admin_token, task)
        assert time.monotonic() - started < 5
        assert mine.task_id == "mine-1" and not mine.rollout_id.startswith(unclaimed)
        for j in range(2):
            withdrawn = await ended(app, f"{unclaimed}-r{j}")
            assert withdrawn.status == "failed"
            assert withdrawn.error.startswith("AgentFailed: withdrawn: nobody had claimed it")
        assert app.live.state.consecutive_failures == 0  # not the harness's failure

        # The runner's group trains first; the withdrawn task is drawn again right after it.
        other = await runner.claim(app.proxy_url, app.admin_token)
        assert other.task_id == "mine-1"

        async def play(claim: runner.Claim, reward: float) -> None:
            oai = AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0)
            await oai.chat.completions.create(
                model=claim.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            await runner.report_reward(claim, reward)
            await runner.finish(claim)

        for claim, reward in ((mine, 1.0), (other, 0.0)):
            await play(claim, reward)
        async with asyncio.timeout(60):
            again = await runner.claim(app.proxy_url, app.admin_token)
            assert again.task_id == set_task
            for claim, reward in ((again, 1.0), (await runner.claim(app.proxy_url, app.admin_token), 0.0)):
                await play(claim, reward)
            assert await run == "reached step 2"


async def test_a_claims_503_names_what_holds_groups_back(app: Appliance) -> None:
    board = app.runners
    assert board is not None
    board.claim_wait_s = 0.2
    status, body, retry = await post(app, "/admin/control", {"action": "pause"}, app.admin_token)
    assert status == 202
    async with asyncio.timeout(5):
        while not app.live.state.paused:
            await app.live.wait_change(app.live.position)
    for claim in ({}, {"task": {"id": "t", "question": "What is 1 + 1?"}}):
        status, body, retry = await post(app, "/admin/rollouts", claim, app.admin_token)
        assert (status, retry) == (503, "30")
        assert "an operator paused the run" in body["error"]["message"]
        assert "training" not in body["error"]["message"]


# --- leases -----------------------------------------------------------------------------------


async def test_a_silent_runner_loses_its_rollout_and_a_live_one_keeps_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = external_config(tmp_path, tiny_model_dir, runner_lease_s=0.6)
    async with Appliance(config) as app:
        await app.controller.start_group(2)
        silent = await runner.claim(app.proxy_url, app.admin_token)
        alive = await runner.claim(app.proxy_url, app.admin_token)
        oai = AsyncOpenAI(base_url=alive.base_url, api_key=alive.api_key, max_retries=0)
        await oai.chat.completions.create(  # a rollout that made no model call is failed
            model=alive.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # past the lease, with heartbeats
            await runner.heartbeat(alive)
            await asyncio.sleep(0.15)
        lost = await ended(app, silent.rollout_id)
        assert lost.status == "failed"
        assert "no sign of life for 0.6 s" in lost.error and "runner_lease_s" in lost.error
        assert app.live.state.rollouts[alive.rollout_id].status == "running"
        with pytest.raises(runner.RunnerError) as late:
            await runner.finish(silent)
        assert late.value.status == 409
        await runner.report_reward(alive, 1.0)
        await runner.finish(alive)
        assert (await ended(app, alive.rollout_id)).status == "finished"


async def test_a_model_call_in_flight_keeps_the_lease(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = external_config(tmp_path, tiny_model_dir, runner_lease_s=0.5)
    async with Appliance(config) as app:
        await app.controller.start_group(1)
        claim = await runner.claim(app.proxy_url, app.admin_token)
        assert app.runner is not None
        gate = app.runner.gate
        gate.close()  # a call now waits at the closed gate, as while training
        oai = AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0)
        call = asyncio.create_task(
            oai.chat.completions.create(
                model=claim.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        )
        await asyncio.sleep(1.2)  # more than twice the lease, all of it inside the call
        assert app.live.state.rollouts[claim.rollout_id].status == "running"
        assert not call.done()
        gate.open()
        await call
        await runner.finish(claim)
        assert (await ended(app, claim.rollout_id)).status == "finished"


# --- errors -----------------------------------------------------------------------------------


async def test_bad_requests_get_clear_errors_and_lose_nothing(app: Appliance) -> None:
    admin = app.admin_token
    status, body, _ = await post(app, "/admin/rollouts", {}, "wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body, _ = await post(app, "/admin/rollouts", {"task": [1, 2]}, admin)
    assert (status, body["error"]["param"]) == (400, "task")
    status, body, _ = await post(app, "/admin/rollouts", {"tsk": {}}, admin)
    assert (status, body["error"]["param"]) == (400, "tsk")
    assert "unknown field 'tsk'" in body["error"]["message"]

    await app.controller.start_group(1)
    claim = await runner.claim(app.proxy_url, admin)
    path = f"/rollouts/{claim.rollout_id}"
    for route in ("/finish", "/heartbeat"):
        status, body, _ = await post(app, path + route, {"status": "finished"}, "la-not-its-key")
        assert status == 401, route
        status, body, _ = await post(app, "/rollouts/nope" + route, {"status": "finished"}, claim.api_key)
        assert (status, body["error"]["code"]) == (401, "invalid_api_key"), route  # as a wrong key
    status, body, _ = await post(app, path + "/finish", {}, claim.api_key)
    assert (status, body["error"]["param"]) == (400, "status")
    status, body, _ = await post(app, path + "/finish", {"status": "done"}, claim.api_key)
    assert (status, body["error"]["param"]) == (400, "status")
    status, body, _ = await post(app, path + "/finish", {"status": "failed", "reason": 3}, claim.api_key)
    assert (status, body["error"]["param"]) == (400, "reason")
    status, body, _ = await post(app, path + "/finish", {"status": "failed", "why": "x"}, claim.api_key)
    assert (status, body["error"]["param"]) == (400, "why")
    # None of that ended the rollout.
    assert app.live.state.rollouts[claim.rollout_id].status == "running"
    status, body, _ = await post(app, path + "/finish", {"status": "finished"}, claim.api_key)
    # Accepted; it made no model call, so the log (and the answer) say failed.
    assert status == 200 and (body["status"], body["reason"][:18]) == ("failed", "made no model call")
    status, body, _ = await post(app, path + "/finish", {"status": "finished"}, claim.api_key)
    assert (status, body["error"]["code"]) == (409, "conflict")
    status, body, _ = await post(app, path + "/heartbeat", None, claim.api_key)
    assert status == 409


async def test_finish_answers_what_the_log_holds_when_the_appliance_failed_the_rollout(
    app: Appliance,
) -> None:
    await app.controller.start_group(1)
    claim = await runner.claim(app.proxy_url, app.admin_token)
    # The runner says finished, but its agent never called the model: nothing to train on.
    status, answer, _ = await post(
        app, f"/rollouts/{claim.rollout_id}/finish", {"status": "finished"}, claim.api_key
    )
    recorded = await ended(app, claim.rollout_id)
    assert recorded.status == "failed" and recorded.error.startswith("made no model call")
    assert status == 200
    assert (answer["status"], answer["reason"]) == ("failed", recorded.error)


async def test_every_route_answers_an_ended_rollout_with_409_and_a_never_existing_one_as_a_wrong_key(
    app: Appliance,
) -> None:
    await app.controller.start_group(1)
    claim = await runner.claim(app.proxy_url, app.admin_token)
    path = f"/rollouts/{claim.rollout_id}"
    status, _, _ = await post(app, path + "/finish", {"status": "finished"}, claim.api_key)
    assert status == 200
    call = {"model": claim.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for route, body in (
        ("/reward", {"reward": 1.0}),
        ("/heartbeat", None),
        ("/finish", {"status": "finished"}),
        ("/v1/chat/completions", call),
    ):
        status, answer, _ = await post(app, path + route, body, claim.api_key)
        assert (status, answer["error"]["code"]) == (409, "conflict"), route
        assert "has already ended" in answer["error"]["message"], route
        status, answer, _ = await post(app, path + route, body, "la-not-its-key")
        assert status == 401, route
        status, answer, _ = await post(app, "/rollouts/g999999-r0" + route, body, claim.api_key)
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key"), route
        assert answer["error"]["message"] == "the API key is not valid for rollout 'g999999-r0'", route
    rewards = [e for e in await events_of(app, claim.rollout_id) if isinstance(e, RewardReported)]
    assert rewards == []  # a refused reward records nothing


async def test_an_appliance_running_its_own_agents_refuses_claims(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
        assert app.runners is None
        status, body, _ = await post(app, "/admin/rollouts", {}, app.admin_token)
    assert status == 409 and 'adapter = "external"' in body["error"]["message"]


async def test_unclaimed_and_claimed_rollouts_fail_as_cancelled_at_the_stop(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with Appliance(external_config(tmp_path, tiny_model_dir)) as app:
        group = await app.controller.start_group(2)
        await runner.claim(app.proxy_url, app.admin_token)
    store = await EventStore.open(tmp_path / "run" / "events.sqlite", readonly=True)
    try:
        finished = [s.event for s in await store.read(types={"RolloutFinished"})]
    finally:
        await store.close()
    assert sorted((e.rollout, e.status) for e in finished if isinstance(e, RolloutFinished)) == [
        (f"{group}-r0", "failed"),
        (f"{group}-r1", "failed"),
    ]
    assert all("cancelled" in e.error for e in finished if isinstance(e, RolloutFinished))


# --- the client's loop --------------------------------------------------------------------------


async def test_run_reports_rewards_and_fails_rollouts_whose_agent_raised(app: Appliance) -> None:
    group = await app.controller.start_group(2)
    seen: list[str] = []

    async def agent(task: dict[str, Any], claim: runner.Claim) -> float:
        seen.append(claim.rollout_id)
        await asyncio.sleep(0)
        if len(seen) == 1:
            raise ValueError("no answer found")
        return 0.5

    outcomes = await runner.run(app.proxy_url, app.admin_token, agent, rollouts=2)
    assert [(o.rollout_id, o.status) for o in outcomes] == [
        (f"{group}-r0", "failed"),
        (f"{group}-r1", "finished"),
    ]
    first = await ended(app, f"{group}-r0")
    assert "ValueError: no answer found" in first.error
    rewards = [e for e in await events_of(app, f"{group}-r1") if isinstance(e, RewardReported)]
    assert [(e.reward, e.source) for e in rewards] == [(0.5, "http")]


async def test_two_runner_processes_complete_a_training_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = external_config(tmp_path, tiny_model_dir, max_steps=1, group_size=2, batch_groups=2)
    async with Appliance(config) as app:
        run = asyncio.create_task(app.run())
        command = [
            sys.executable, "-m", "harness_adapters.runner", "--url", app.proxy_url,
            "--agent", "tests.appliance.external_agent:agent", "--rollouts", "2",
        ]  # fmt: skip
        env = {**os.environ, "APPLIANCE_ADMIN_TOKEN": app.admin_token, "PYTHONPATH": str(ROOT)}
        runners = [
            await asyncio.create_subprocess_exec(
                *command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            for _ in range(2)
        ]
        async with asyncio.timeout(90):
            outputs = [(await proc.communicate())[0].decode() for proc in runners]
            reason = await run
        assert [proc.returncode for proc in runners] == [0, 0], outputs
        assert reason == "reached step 1"
        (step,) = [s.event for s in await app.store.read(types={"TrainStepCompleted"})]
        assert isinstance(step, TrainStepCompleted)
        assert len(step.rollouts) == 4
        rewards = {
            s.event.rollout: s.event
            for s in await app.store.read(types={"RewardReported"})
            if isinstance(s.event, RewardReported)
        }
        assert set(step.rollouts) <= set(rewards)
        assert all(rewards[r].source == "http" for r in step.rollouts)
        ran = [line.split()[0] for out in outputs for line in out.splitlines() if " finished reward=" in line]
        assert sorted(ran) == sorted(step.rollouts)  # each process ran two of them


async def test_run_heartbeats_while_a_slow_agent_thinks(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = external_config(tmp_path, tiny_model_dir, runner_lease_s=0.6)
    async with Appliance(config) as app:
        group = await app.controller.start_group(1)

        def slow(task: dict[str, Any], claim: runner.Claim) -> float:
            time.sleep(1.5)  # a plain function (in a thread), silent for more than twice the lease
            with OpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0) as oai:
                oai.chat.completions.create(  # a rollout that made no model call is failed
                    model=claim.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            return 1.0

        (outcome,) = await runner.run(app.proxy_url, app.admin_token, slow, rollouts=1)
        assert outcome == runner.Outcome(f"{group}-r0", "finished", reward=1.0)
        assert (await ended(app, f"{group}-r0")).status == "finished"
