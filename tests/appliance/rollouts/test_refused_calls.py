"""Rollouts whose model calls the proxy refused, through a real proxy and a real store.

An agent whose every call is refused (a completion limit past the tiny model's 2048-token
context: ``context_length_exceeded``) and that still reports a reward, as smolagents does, is
failed with the refusal as its reason, each refusal recorded as ``LLMCallRefused``, and its group
is trained without it. So is one that refused more than ``max_refused_fraction`` of its calls,
and one that never called the model; a wrong key or another route records nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from appliance.app import Appliance
from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import PythonAdapter
from store.events import LLMCallRefused, RolloutFinished, TrainStepCompleted
from store.projections import RunState
from tests.support import make_config

#: What the agent of each rollout of the first group does; every other rollout calls once, fine.
PLANS = {
    "g000000-r0": ("refused", "refused"),  # every call refused
    "g000000-r1": ("ok", "refused", "refused"),  # 2 of 3 refused: more than half
    "g000001-r0": (),  # never calls the model
    "g000001-r1": ("ok", "refused"),  # 1 of 2 refused: not more than half
}


async def plan_agent(task: Task, client: ClientConfig) -> float:
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        for step in PLANS.get(client.rollout_id, ("ok",)):
            try:
                await oai.chat.completions.create(
                    model=client.model,
                    messages=[{"role": "user", "content": "What is 1 + 1?"}],
                    # Past the context with any prompt: the proxy refuses it before generating.
                    max_tokens=2048 if step == "refused" else 4,
                )
            except openai.BadRequestError as error:
                assert error.code == "context_length_exceeded"
    return 1.0  # the agent ends as if all went well


async def test_refused_rollouts_are_failed_with_the_refusal_and_never_trained(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=1, breaker_failures=0)
    async with Appliance(config, adapter=PythonAdapter(plan_agent)) as app:
        assert await app.run() == "reached step 1"
        state = app.live.state
        events = [s.event for s in await app.store.read()]

    ends = {e.rollout: e for e in events if isinstance(e, RolloutFinished)}
    every = ends["g000000-r0"]
    assert every.status == "failed"
    first_line = every.error.splitlines()[0]
    assert first_line.startswith("every model call was refused: 2 of 2 (context_length_exceeded: ")
    assert "maximum context length is 2048 tokens" in first_line
    most = ends["g000000-r1"]
    assert most.status == "failed"
    assert most.error.startswith(
        "2 of 3 model calls were refused, more than max_refused_fraction (0.5); "
        "last: context_length_exceeded: "
    )
    assert ends["g000001-r0"].status == "failed"
    assert ends["g000001-r0"].error.startswith("made no model call")
    assert ends["g000001-r1"].status == "finished"

    refused = [e for e in events if isinstance(e, LLMCallRefused)]
    assert sorted(e.rollout for e in refused) == ["g000000-r0"] * 2 + ["g000000-r1"] * 2 + ["g000001-r1"]
    for event in refused:
        assert (event.route, event.status, event.code, event.error_type) == (
            "/chat/completions",
            400,
            "context_length_exceeded",
            "invalid_request_error",
        )
    views = state.rollouts
    assert [views[r].refused_calls for r in PLANS] == [2, 2, 0, 1]
    assert [views[r].call_count for r in PLANS] == [0, 1, 0, 1]
    assert views["g000000-r0"].last_refusal.startswith("context_length_exceeded: This model's maximum")

    (step,) = [e for e in events if isinstance(e, TrainStepCompleted)]
    failed = {"g000000-r0", "g000000-r1", "g000001-r0"}
    # The dead group (both failed) is replaced; the step consumes g000001 with its failed rollout
    # counted, not trained on: 3 rollouts of one call each give the step its samples.
    assert set(step.rollouts) == {"g000001-r0", "g000001-r1", "g000002-r0", "g000002-r1"}
    assert step.metrics["rollouts_failed"] == 1.0
    assert step.samples == 3
    assert not any(RunState.trainable(views[r]) for r in failed)


async def test_a_wrong_key_or_another_route_records_no_refusal(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir)

    async def waiting_agent(task: Task, client: ClientConfig) -> float:
        await asyncio.sleep(60)  # cancelled when the appliance closes
        return 0.0

    async with Appliance(config, adapter=PythonAdapter(waiting_agent)) as app:
        group = await app.controller.start_group(1)
        rollout = f"{group}-r0"
        base = f"{app.proxy_url}/rollouts/{rollout}"
        body = {"model": app.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2048}
        async with aiohttp.ClientSession() as http:
            wrong = await http.post(
                f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer x"}
            )
            assert wrong.status == 401
            unknown = await http.post(
                f"{app.proxy_url}/rollouts/nobody/v1/chat/completions",
                json=body,
                headers={"Authorization": "Bearer x"},
            )
            assert unknown.status == 401  # as a wrong key: rollout ids cannot be probed
            admin = {"Authorization": f"Bearer {app.admin_token}"}
            plain = await http.post(f"{app.proxy_url}/v1/chat/completions", json=body, headers=admin)
            assert plain.status == 400  # the rollout-less routes: refused, not recorded
        await app.controller.close()
        refused = await app.store.read(types={"LLMCallRefused"})
    assert refused == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_streamed_or_whole_refusal_is_recorded_before_the_answer(
    tmp_path: Path, tiny_model_dir: Path, stream: bool
) -> None:
    config = make_config(tmp_path, tiny_model_dir)
    async with Appliance(config, adapter=PythonAdapter(plan_agent)) as app:
        active = app.registry.register("r1", task_id="t", group="g", task={})
        oai = AsyncOpenAI(base_url=f"{app.proxy_url}/rollouts/r1/v1", api_key=active.token, max_retries=0)
        with pytest.raises(openai.BadRequestError):
            await oai.chat.completions.create(
                model=app.model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2048,
                stream=stream,
            )
        # Durable by the time the client has the answer.
        (stored,) = await app.store.read(types={"LLMCallRefused"})
        assert isinstance(stored.event, LLMCallRefused) and stored.event.rollout == "r1"
        assert (active.refused, active.calls) == (1, 0)
        assert active.last_refusal == stored.event.reason()
