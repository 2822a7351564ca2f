"""A rollout's requests read through its conversation memo: what each call renders and records is
what that request says, whatever the earlier requests held."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.chat.messages import messages_from_openai
from appliance.chat.render import render_text
from appliance.rollouts.registry import ActiveRollout
from tests.support import make_config, recorded_calls, rollout_base


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=6)) as appliance:
        yield appliance


@pytest.fixture
def active(app: Appliance) -> ActiveRollout:
    return app.registry.register("r1", task_id="t", group="g", task={})


async def _post(app: Appliance, active: ActiveRollout, messages: list[dict[str, Any]]) -> tuple[int, Any]:
    url = rollout_base(app, active) + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {active.token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"model": "m", "messages": messages}, headers=headers) as response,
    ):
        return response.status, await response.json()


def _tool_turn(value: Any) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": value}}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]


async def test_each_call_renders_and_records_its_own_request(app: Appliance, active: ActiveRollout) -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}]
    status, answer = await _post(app, active, history)
    assert status == 200
    history += [answer["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    sent = [
        history,
        [*history, *_tool_turn(1), {"role": "user", "content": "next"}],
        # Equal JSON to the last request (1 == true), which renders differently.
        [*history, *_tool_turn(True), {"role": "user", "content": "next"}],
        [*history, *_tool_turn(True), {"role": "user", "content": "next"}, {"role": "robot", "content": "x"}],
        [*history, {"role": "user", "content": "edited"}],
    ]
    statuses = [(await _post(app, active, messages))[0] for messages in sent]
    assert statuses == [200, 200, 200, 400, 200]
    calls = (await recorded_calls(app))[1:]
    tokenizer = app.registry._tokenizer
    answered = [messages for messages, status in zip(sent, statuses, strict=True) if status == 200]
    for call, messages in zip(calls, answered, strict=True):
        assert call.request["messages"] == messages
        expected = render_text(messages_from_openai(messages))
        assert tokenizer.decode(list(call.prompt_ids)) == expected
    assert calls[0].spliced_tokens > 0
    assert '"arguments": {"x": 1}' in tokenizer.decode(list(calls[1].prompt_ids))
    assert '"arguments": {"x": true}' in tokenizer.decode(list(calls[2].prompt_ids))


async def test_a_refused_message_names_its_position(app: Appliance, active: ActiveRollout) -> None:
    history = [{"role": "user", "content": "go"}]
    assert (await _post(app, active, history))[0] == 200
    status, body = await _post(app, active, [*history, {"role": "assistant", "content": 5}])
    assert status == 400
    assert body["error"]["param"] == "messages[1].content"


async def test_a_conversation_is_read_from_where_its_last_body_ended(
    app: Appliance, active: ActiveRollout, whole_reads: list[bytes]
) -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": "S"}]
    for turn in range(4):
        history.append({"role": "user", "content": f"turn {turn}"})
        status, answer = await _post(app, active, history)
        assert status == 200
        history.append(answer["choices"][0]["message"])
    assert len(whole_reads) == 1  # the first body; each later one from where the one before ended
    assert active.transcript.body.messages == history[:-1]
    calls = (await recorded_calls(app))[-4:]
    assert [call.request["messages"] for call in calls] == [history[: 2 * n + 2] for n in range(4)]
    assert all(call.spliced_tokens > 0 for call in calls[1:])
