"""Structured outputs are enforced, not just accepted: ``response_format`` (json_object,
json_schema) and a forced ``tool_choice`` on every surface, whole and streamed, through the
official SDKs against the tiny random model (which left alone writes neither JSON nor tool
calls). Each constrained call records its grammar with the sampling parameters."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic import AsyncAnthropic

from appliance.app import Appliance
from tests.support import make_config, recorded_calls
from tests.support import openai_client as sdk
from tests.support import register_rollout as rollout
from tests.support import rollout_base as base

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK: Any = [{"role": "user", "content": "Weather in Paris for 3 days, as JSON."}]
#: Enough tokens for the tiny model to close the JSON it is held to (it pads nothing: compact).
ROOM = 200


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens_cap=ROOM)) as appliance:
        yield appliance


def _matches(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"city", "days"}
        and isinstance(value["city"], str)
        and len(value["city"]) <= 12
        and isinstance(value["days"], int)
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_response_format_is_enforced(app: Appliance, stream: bool) -> None:
    active = rollout(app)
    schema_format = {"type": "json_schema", "json_schema": {"name": "plan", "schema": SCHEMA, "strict": True}}
    async with sdk(app, active) as client:
        for seed in range(3):
            texts: dict[str, str] = {}
            finishes: dict[str, str | None] = {}
            for kind, fmt in (("json_object", {"type": "json_object"}), ("json_schema", schema_format)):
                kwargs: dict[str, Any] = {
                    "model": app.model_name,
                    "messages": ASK,
                    "max_tokens": ROOM,
                    "seed": seed,
                    "response_format": fmt,
                }
                texts[kind] = ""
                if stream:
                    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
                        for choice in chunk.choices:
                            texts[kind] += choice.delta.content or ""
                            finishes[kind] = choice.finish_reason or finishes.get(kind)
                else:
                    completion = await client.chat.completions.create(**kwargs)
                    finishes[kind] = completion.choices[0].finish_reason
                    texts[kind] = completion.choices[0].message.content or ""
            # Any object may run past the limit (a random model rarely closes a long string);
            # what it wrote is then the start of one. Once it stops, it is one.
            assert texts["json_object"].startswith("{"), texts["json_object"]
            if finishes["json_object"] == "stop":
                assert isinstance(json.loads(texts["json_object"]), dict), texts["json_object"]
            assert finishes["json_schema"] == "stop"
            assert _matches(json.loads(texts["json_schema"])), texts["json_schema"]
    calls = await recorded_calls(app)
    kinds = [(c.sampling.get("constraint") or {}).get("kind") for c in calls]
    assert kinds == ["json_object", "json_schema"] * 3
    assert all("%json" in c.sampling["constraint"]["grammar"] for c in calls)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_forced_tool_choice_is_enforced(app: Appliance, stream: bool) -> None:
    active = rollout(app)
    async with sdk(app, active) as client:
        for choice, names in (
            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
            ("required", {"get_weather", "get_time"}),
        ):
            kwargs: dict[str, Any] = {
                "model": app.model_name,
                "messages": ASK,
                "max_tokens": ROOM,
                "tools": [WEATHER, TIME],
                "tool_choice": choice,
                "temperature": 1.0,
            }
            if stream:
                called: list[tuple[str, str]] = []
                async for chunk in await client.chat.completions.create(**kwargs, stream=True):
                    for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                        assert delta.function is not None
                        called.append((delta.function.name or "", delta.function.arguments or ""))
            else:
                completion = await client.chat.completions.create(**kwargs)
                assert completion.choices[0].finish_reason == "tool_calls"
                message = completion.choices[0].message
                called = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            assert called, "a forced tool choice must produce a call"
            assert {name for name, _ in called} <= names
            if isinstance(choice, dict):
                assert len(called) == 1
            for name, arguments in called:
                parsed = json.loads(arguments)
                assert isinstance(parsed, dict)
                if name == "get_weather":
                    assert set(parsed) <= {"city"} and len(parsed.get("city", "")) <= 10


async def test_responses_text_format_and_tool_choice_are_enforced(app: Appliance) -> None:
    active = rollout(app)
    async with sdk(app, active) as client:
        response = await client.responses.create(
            model=app.model_name,
            input="Weather in Paris?",
            max_output_tokens=ROOM,
            text={"format": {"type": "json_schema", "name": "plan", "schema": SCHEMA, "strict": True}},
        )
        assert response.status == "completed"
        assert _matches(json.loads(response.output_text))
        tools: Any = [{"type": "function", **WEATHER["function"], "strict": True}]
        response = await client.responses.create(
            model=app.model_name,
            input="Weather in Paris?",
            max_output_tokens=ROOM,
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_tool_choice_any_and_tool_are_enforced(app: Appliance, stream: bool) -> None:
    active = rollout(app)
    tools: Any = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)
    ]
    sdk_client = AsyncAnthropic(base_url=base(app, active), api_key=active.token, max_retries=0)
    for choice, names in (
        ({"type": "tool", "name": "get_weather"}, {"get_weather"}),
        ({"type": "any"}, None),
    ):
        kwargs: dict[str, Any] = {
            "model": app.model_name,
            "max_tokens": ROOM,
            "messages": ASK,
            "tools": tools,
            "tool_choice": choice,
        }
        if stream:
            async with sdk_client.messages.stream(**kwargs) as events:
                message = await events.get_final_message()
        else:
            message = await sdk_client.messages.create(**kwargs)
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use"
        assert uses
        assert all(isinstance(u.input, dict) for u in uses)
        if names is not None:
            assert [u.name for u in uses] == ["get_weather"]
    await sdk_client.close()


async def test_a_schema_the_grammar_cannot_take_is_a_400_before_anything_runs(app: Appliance) -> None:
    active = rollout(app)
    bad: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
    }
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=app.model_name,
                messages=ASK,
                max_tokens=8,
                response_format=bad,
            )
        assert caught.value.param == "response_format"
        nameless: Any = {"type": "json_schema"}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=app.model_name,
                messages=ASK,
                max_tokens=8,
                response_format=nameless,
            )
        assert caught.value.param == "response_format"
    assert await recorded_calls(app) == []


#: A schema no finite JSON value matches: every value needs another inside it. llguidance
#: compiles it and only fails while sampling (ParserTooComplex); the answer was `{"`, "stop".
ENDLESS: dict[str, Any] = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


async def test_a_schema_no_value_matches_is_a_400_naming_it_on_every_surface(app: Appliance) -> None:
    active = rollout(app)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}
    endless_tool: Any = {"type": "function", "function": {"name": "nest", "parameters": ENDLESS}}
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=app.model_name, messages=ASK, max_tokens=8, response_format=fmt
            )
        assert (caught.value.status_code, caught.value.type) == (400, "invalid_request_error")
        assert caught.value.param == "response_format"
        assert "no finite JSON value" in caught.value.message
        assert "#/properties/a refers to '#'" in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=app.model_name,
                messages=ASK,
                max_tokens=8,
                tools=[WEATHER, endless_tool],
                tool_choice="required",
            )
        assert caught.value.param == "tools[1]"
        assert "tool 'nest'" in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(
                model=app.model_name,
                input="Hi",
                max_output_tokens=16,
                text={"format": {"type": "json_schema", "name": "x", "schema": ENDLESS}},
            )
        assert caught.value.param == "text"
        assert "no finite JSON value" in caught.value.message
    async with AsyncAnthropic(base_url=base(app, active), api_key=active.token, max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(
                model=app.model_name,
                max_tokens=8,
                messages=ASK,
                tools=[{"name": "nest", "input_schema": ENDLESS}],
                tool_choice={"type": "any"},
            )
        assert "no finite JSON value" in str(refused.value.body)
    # A tool that is declared but not forced is no constraint: the call goes ahead.
    async with sdk(app, active) as client:
        await client.chat.completions.create(
            model=app.model_name, messages=ASK, max_tokens=2, tools=[endless_tool]
        )
    assert len(await recorded_calls(app)) == 1


async def test_a_grammar_that_breaks_while_sampling_fails_the_call_instead_of_answering(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the check before generation out of the way, the endless schema reaches the engine,
    # whose grammar breaks after a few tokens: the call is a 400, never text that breaks it.
    monkeypatch.setattr("appliance.chat.constraints.no_finite_value", lambda schema: None)
    active = rollout(app)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=app.model_name, messages=ASK, max_tokens=ROOM, response_format=fmt
            )
    assert caught.value.status_code == 400
    assert "cannot be enforced" in caught.value.message
    assert await recorded_calls(app) == []
