"""The Anthropic Messages surface through the real anthropic SDK, and raw HTTP for bad input."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
from anthropic import AsyncAnthropic
from anthropic.types import Message as AnthropicMessage
from anthropic.types import MessageParam, ToolParam

from appliance.app import Appliance
from appliance.chat.messages import Message, ToolCall
from appliance.chat.render import render_text
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.tools import new_tool_call_id
from appliance.proxy.anthropic_messages import MessageEvents, to_content, to_messages, to_tools
from appliance.proxy.pipeline import Answer, Started
from appliance.rollouts.registry import ActiveRollout
from contracts.errors import StoreError
from tests.support import make_config
from tests.support import recorded_calls as calls_recorded
from tests.support import register_rollout as rollout
from tests.support import rollout_base as base

WEATHER_TOOL: ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
AS_FUNCTION = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_TOOL["input_schema"],
    },
}


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def client(app: Appliance, active: ActiveRollout, key: str | None = None) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=base(app, active), api_key=key or active.token, max_retries=0)


def text_of(message: AnthropicMessage) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def test_plain_message(app: Appliance) -> None:
    active = rollout(app)
    async with client(app, active) as sdk:
        response = await sdk.messages.create(
            model=app.model_name, max_tokens=6, messages=[{"role": "user", "content": "What is 1 + 2?"}]
        )
    (call,) = await calls_recorded(app)
    assert response.id == "msg_" + call.call_id
    assert (response.type, response.role, response.model) == ("message", "assistant", app.model_name)
    assert response.usage.input_tokens == len(call.prompt_ids)
    assert response.usage.output_tokens == len(call.response_ids) <= 6
    assert response.usage.cache_read_input_tokens == 0
    expected = "max_tokens" if call.finish_reason == "length" else "end_turn"
    assert (response.stop_reason, response.stop_sequence) == (expected, None)
    assert text_of(response) == call.response_text
    assert all(block.type == "text" and block.text for block in response.content)
    assert call.surface == "anthropic.messages"
    assert call.request["max_tokens"] == 6
    assert "anthropic" in call.user_agent.lower()


async def test_count_tokens_is_the_rendered_prompt_length_and_records_nothing(app: Appliance) -> None:
    active = rollout(app)
    messages: list[MessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with client(app, active) as sdk:
        counted = await sdk.messages.count_tokens(
            model=app.model_name, system="Be brief.", messages=messages, tools=[WEATHER_TOOL]
        )
        created = await sdk.messages.create(
            model=app.model_name, max_tokens=3, system="Be brief.", messages=messages, tools=[WEATHER_TOOL]
        )
    (call,) = await calls_recorded(app)  # only the create() call was recorded
    assert counted.input_tokens == len(call.prompt_ids) == created.usage.input_tokens
    bare = await AsyncAnthropic(base_url=base(app, active), api_key=active.token).messages.count_tokens(
        model=app.model_name, messages=messages
    )
    assert bare.input_tokens < counted.input_tokens  # the tool schema and system are counted


@pytest.mark.parametrize(
    "system",
    [
        "You are a careful calculator.",
        [{"type": "text", "text": "You are a careful"}, {"type": "text", "text": "calculator."}],
    ],
)
async def test_system_prompt_is_in_the_prompt_tokens(
    app: Appliance, tokenizer: Tokenizer, system: Any
) -> None:
    active = rollout(app)
    async with client(app, active) as sdk:
        await sdk.messages.create(
            model=app.model_name, max_tokens=2, system=system, messages=[{"role": "user", "content": "Hi"}]
        )
    (call,) = await calls_recorded(app)
    prompt = tokenizer.decode(call.prompt_ids)
    text = system if isinstance(system, str) else "You are a careful\ncalculator."
    assert prompt == render_text([Message("system", text), Message("user", "Hi")])
    assert prompt.startswith(f"<|im_start|>system\n{text}<|im_end|>\n")


async def test_streaming_matches_the_recorded_call(app: Appliance) -> None:
    active = rollout(app)
    async with (
        client(app, active) as sdk,
        sdk.messages.stream(
            model=app.model_name, max_tokens=8, messages=[{"role": "user", "content": "Count to five."}]
        ) as stream,
    ):
        deltas = [delta async for delta in stream.text_stream]
        final = await stream.get_final_message()
    (call,) = await calls_recorded(app)
    assert "".join(deltas) == text_of(final) == call.response_text
    assert final.id == "msg_" + call.call_id
    assert final.usage.input_tokens == len(call.prompt_ids)
    assert final.usage.output_tokens == len(call.response_ids)
    assert final.stop_reason == ("max_tokens" if call.finish_reason == "length" else "end_turn")
    assert call.surface == "anthropic.messages"


async def test_tool_use_and_tool_result_are_rendered(app: Appliance, tokenizer: Tokenizer) -> None:
    active = rollout(app)
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "22C"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    async with client(app, active) as sdk:
        await sdk.messages.create(model=app.model_name, max_tokens=2, tools=[WEATHER_TOOL], messages=messages)
        await sdk.messages.create(
            model=app.model_name,
            max_tokens=2,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "none"},
            messages=messages,
        )
    first, second = await calls_recorded(app)
    prompt = tokenizer.decode(first.prompt_ids)
    expected = [
        Message("user", "Weather in Paris?"),
        Message("assistant", "Let me check.", (ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", "sunny", tool_call_id="toolu_1"),
        Message("tool", "22C", tool_call_id="toolu_2"),
        Message("user", "And tomorrow?"),
    ]
    assert prompt == render_text(expected, [AS_FUNCTION])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]  # the tool list, in the system turn
    assert tokenizer.decode(second.prompt_ids) == render_text(expected)  # tool_choice none: no tool list


async def test_reply_sent_back_is_spliced_token_exactly(app: Appliance) -> None:
    active = rollout(app)
    async with client(app, active) as sdk:
        history: list[Any] = [{"role": "user", "content": "Hi"}]
        first = await sdk.messages.create(model=app.model_name, max_tokens=6, messages=history)
        history += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And?"}]
        await sdk.messages.create(model=app.model_name, max_tokens=6, messages=history)
    one, two = await calls_recorded(app)
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
    assert two.spliced_tokens == len(one.response_ids)
    assert two.unmatched_assistant_turns == 0


async def test_streamed_tool_call_round_trips_token_exactly(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model never writes a tool call, so the parser is made to read one from any text."""

    def parse(text: str, tool_names: Any, **_: Any) -> Message:
        if not tool_names:
            return Message("assistant", text)
        arguments = json.dumps({"city": "Zürich", "days": 1.5}, ensure_ascii=False)
        return Message("assistant", text, (ToolCall(new_tool_call_id(), "get_weather", arguments),))

    monkeypatch.setattr("appliance.proxy.calls.parse_assistant", parse)
    active = rollout(app)
    history: list[Any] = [{"role": "user", "content": "Weather in Zürich?"}]
    async with client(app, active) as sdk:
        async with sdk.messages.stream(
            model=app.model_name, max_tokens=6, tools=[WEATHER_TOOL], messages=history
        ) as stream:
            deltas = [delta async for delta in stream.text_stream]
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use"
        tool_use = final.content[-1]
        assert tool_use.type == "tool_use"
        assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Zürich", "days": 1.5})
        assert tool_use.id.startswith("toolu_")
        history += [
            {"role": "assistant", "content": final.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "cold"}],
            },
        ]
        await sdk.messages.create(model=app.model_name, max_tokens=2, tools=[WEATHER_TOOL], messages=history)
    one, two = await calls_recorded(app)
    assert "".join(deltas) == text_of(final) == one.response_text
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
    assert two.unmatched_assistant_turns == 0


def test_tool_calls_convert_back_to_the_same_turn() -> None:
    """What the proxy returns for a tool-calling turn keys to the same turn when it comes back."""
    arguments = json.dumps({"city": "Zürich", "n": [1, 2.5, None], "deep": {"ok": True}}, ensure_ascii=False)
    call = ToolCall("call_abc", "get_weather", arguments)
    sampled = Message("assistant", "Checking.", (call,), reasoning="They want weather.")
    content = json.loads(json.dumps(to_content(sampled)))  # through the wire, as the harness sees it
    assert content[0] == {"type": "thinking", "thinking": "They want weather.", "signature": ""}
    assert content[1] == {"type": "text", "text": "Checking."}
    assert content[2]["id"] == "toolu_abc"
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_abc"}]},
        ]
    }
    back = to_messages(body)[1]
    assert back.key == sampled.key
    assert back.reasoning == sampled.reasoning
    assert to_messages(body)[2] == Message("tool", "", tool_call_id="toolu_abc")
    assert to_tools({"tools": [WEATHER_TOOL]}) == [AS_FUNCTION]
    assert to_tools({"tools": [WEATHER_TOOL], "tool_choice": {"type": "none"}}) == []


async def test_stop_sequences_report_which_one_matched(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Greedy sampling: a first call shows the text, a second stops at a piece of it."""
    config = make_config(tmp_path, tiny_model_dir, temperature=0.0, max_tokens=24)
    async with Appliance(config) as app:
        prompt: list[Any] = [{"role": "user", "content": "Tell me a story."}]
        async with client(app, rollout(app, "a")) as sdk:
            full = text_of(await sdk.messages.create(model="m", max_tokens=24, messages=prompt))
        # A plain two-letter piece after the first character (so the cut text is not empty).
        at = next(
            i for i in range(1, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isalnum()
        )
        sequence = full[at : at + 2]
        cut = full[: full.index(sequence)]
        for name, streaming in (("b", False), ("c", True)):
            async with client(app, rollout(app, name)) as sdk:
                kwargs: dict[str, Any] = {"model": "m", "max_tokens": 24, "messages": prompt}
                kwargs["stop_sequences"] = ["never-sampled-xyz", sequence]
                if streaming:
                    async with sdk.messages.stream(**kwargs) as stream:
                        response = await stream.get_final_message()
                else:
                    response = await sdk.messages.create(**kwargs)
            assert (response.stop_reason, response.stop_sequence) == ("stop_sequence", sequence)
            assert text_of(response) == cut


def _answer(message: Message) -> Answer:
    return Answer(
        index=0,
        prompt_index=0,
        call_id="c1",
        message=message,
        text=message.content,
        finish_reason="stop",
        stop_sequence=None,
        prompt_tokens=3,
        completion_tokens=5,
        policy_version=0,
    )


@pytest.mark.parametrize(
    ("deltas", "final", "blocks"),
    [
        # A reasoning format: <think> text streams as a thinking block, the answer as text.
        (
            ["<thi", "nk>\nHmm, ", "let me think.</th", "ink>\n\n", "Hello", " world"],
            Message("assistant", "Hello world", reasoning="Hmm, let me think."),
            [("thinking", "Hmm, let me think."), ("text", "Hello world")],
        ),
        # With tools, trailing whitespace waits: the turn's text is stripped before tool calls.
        (
            ["Let me", " check.\n", "\n"],
            Message("assistant", "Let me check.", (ToolCall("call_1", "get_weather", "{}"),)),
            [("text", "Let me check.")],
        ),
        # Text held back to the end (a partial marker) is sent from the final turn.
        (["Hello <tool"], Message("assistant", "Hello <tool"), [("text", "Hello <tool")]),
    ],
)
def test_streamed_blocks_equal_the_final_turn(
    deltas: list[str], final: Message, blocks: list[tuple[str, str]]
) -> None:
    stream = MessageEvents(Started("c1", 3), "m", reasoning=True, hold_space=True)
    events = [event for delta in deltas for event in stream.text(delta)]
    events += stream.closing(_answer(final))
    texts: dict[int, str] = {}
    kinds: dict[int, str] = {}
    open_blocks: list[int] = []
    for kind, data in events:
        assert data["type"] == kind
        if kind in ("message_delta", "message_stop"):
            continue
        if kind == "content_block_start":
            assert not open_blocks  # one block at a time
            open_blocks.append(data["index"])
            kinds[data["index"]] = data["content_block"]["type"]
            texts[data["index"]] = ""
        elif kind == "content_block_delta":
            assert open_blocks == [data["index"]]
            delta = data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
            texts[data["index"]] += delta[key[delta["type"]]]
        elif kind == "content_block_stop":
            assert open_blocks.pop() == data["index"]
    assert not open_blocks
    uses = [(kinds[i], texts[i]) for i in sorted(texts) if kinds[i] == "tool_use"]
    assert [(kinds[i], texts[i]) for i in sorted(texts) if kinds[i] != "tool_use"] == blocks
    assert uses == [("tool_use", call.arguments) for call in final.tool_calls]


GOOD: dict[str, Any] = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


@pytest.mark.parametrize(
    ("body", "status", "kind", "mentions"),
    [
        ({"model": "m", "messages": GOOD["messages"]}, 400, "invalid_request_error", "max_tokens"),
        ({**GOOD, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        (b"{not json", 400, "invalid_request_error", "JSON"),
        (
            {**GOOD, "messages": [{"role": "user", "content": [IMAGE]}]},
            400,
            "invalid_request_error",
            "'image'",
        ),
        ({**GOOD, "system": [IMAGE]}, 400, "invalid_request_error", "system[0]"),
        ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "role"),
        (
            {**GOOD, "messages": [*GOOD["messages"], {"role": "assistant", "content": "x"}]},
            400,
            "invalid_request_error",
            "prefill",
        ),
        (
            {
                **GOOD,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
                ],
            },
            400,
            "invalid_request_error",
            "'tool_use'",
        ),
        ({**GOOD, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({**GOOD, "stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
        ({**GOOD, "tools": [{"name": "f"}]}, 400, "invalid_request_error", "input_schema"),
        ({**GOOD, "tool_choice": {"type": "tool", "name": "f"}}, 400, "invalid_request_error", "tool_choice"),
        ({**GOOD, "stream": "yes"}, 400, "invalid_request_error", "stream"),
        (
            {**GOOD, "messages": [{"role": "user", "content": "1 2 3 4 " * 900}]},
            400,
            "invalid_request_error",
            "prompt is too long",
        ),
        ("wrong key", 401, "authentication_error", ""),
        ("no rollout", 401, "authentication_error", ""),  # as a wrong key: ids cannot be probed
    ],
)
async def test_bad_requests_get_anthropic_errors_and_nothing_is_recorded(
    app: Appliance, body: Any, status: int, kind: str, mentions: str
) -> None:
    active = rollout(app)
    url = base(app, active) + "/v1/messages"
    headers = {
        "x-api-key": active.token,
        "anthropic-version": "2023-06-01",
        "Content-Type": "application/json",
    }
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    if body == "wrong key":
        headers["x-api-key"], kwargs = "wrong", {"json": GOOD}
    elif body == "no rollout":
        url, kwargs = f"{app.proxy_url}/rollouts/nope/v1/messages", {"json": GOOD}
    async with aiohttp.ClientSession() as http:
        response = await http.post(url, headers=headers, **kwargs)
        payload = await response.json()
        assert response.status == status, payload
        assert payload["type"] == "error"
        assert payload["error"]["type"] == kind
        assert mentions in payload["error"]["message"]
        assert await calls_recorded(app) == []
        # The appliance keeps serving after the bad request.
        again = await http.post(
            base(app, active) + "/v1/messages", headers=headers | {"x-api-key": active.token}, json=GOOD
        )
        assert again.status == 200, await again.text()
        assert (await again.json())["type"] == "message"
    assert len(await calls_recorded(app)) == 1


async def test_anthropic_error_shape_on_other_routes(app: Appliance) -> None:
    async with aiohttp.ClientSession() as http:
        plain = await http.post(f"{app.proxy_url}/v1/messages", json=GOOD, headers={"x-api-key": "nope"})
        assert plain.status == 401
        assert (await plain.json())["error"]["type"] == "authentication_error"
        missing = await http.post(
            f"{app.proxy_url}/v1/messages/batches",
            json=GOOD,
            headers={"anthropic-version": "2023-06-01"},
        )
        assert missing.status == 404
        assert (await missing.json())["type"] == "error"
        admin = await http.post(
            f"{app.proxy_url}/v1/messages", json=GOOD, headers={"x-api-key": app.admin_token}
        )
        assert admin.status == 200, await admin.text()


async def test_the_sdk_raises_authentication_error_on_a_wrong_key(app: Appliance) -> None:
    active = rollout(app)
    async with client(app, active, key="not-the-token") as sdk:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await sdk.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 401
    assert await calls_recorded(app) == []


async def test_an_error_mid_stream_is_an_error_event(app: Appliance, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the stream has started, a failure (here: the store) reaches the SDK as an error event."""

    async def broken(events: Any) -> list[int]:
        raise StoreError("the disk is full")

    monkeypatch.setattr(app.store, "append", broken)
    active = rollout(app)
    async with client(app, active) as sdk:
        with pytest.raises(anthropic.APIStatusError, match="the disk is full") as raised:
            async with sdk.messages.stream(
                model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                await stream.get_final_message()
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["error"]["type"] == "overloaded_error"
