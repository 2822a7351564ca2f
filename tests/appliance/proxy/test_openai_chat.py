"""Chat Completions features through the real openai SDK: streaming, tools, n, stop, logprobs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from appliance.app import Appliance
from appliance.chat.tools import new_tool_call_id
from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams
from appliance.rollouts.registry import ActiveRollout
from store.events import Event, LLMCallCompleted
from tests.support import make_config
from tests.support import openai_client as client
from tests.support import recorded_calls as recorded
from trainer.samples import build_samples


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=12)) as appliance:
        yield appliance


@pytest.fixture
def active(app: Appliance) -> ActiveRollout:
    return app.registry.register("r1", task_id="t", group="g", task={})


USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 3 + 4?"}]


async def test_streaming_deltas_match_the_recorded_call(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        stream = await oai.chat.completions.create(
            model="m", messages=USER, stream=True, stream_options={"include_usage": True}, max_tokens=10
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    (usage_chunk,) = [c for c in chunks if c.usage is not None]
    (call,) = await recorded(app)
    assert text == call.response_text
    assert finishes == ["length" if call.finish_reason == "length" else "stop"]
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == len(call.response_ids)
    assert usage_chunk.usage.prompt_tokens == len(call.prompt_ids)
    assert 0 < call.ttft_s <= call.total_s


async def test_n_choices_are_each_recorded(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        response = await oai.chat.completions.create(model="m", messages=USER, n=3, max_tokens=5)
    calls = await recorded(app)
    assert len(response.choices) == len(calls) == 3
    assert {c.message.content for c in response.choices} <= {call.response_text for call in calls}


async def test_logprobs_are_returned_when_asked(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        response = await oai.chat.completions.create(
            model="m", messages=USER, logprobs=True, top_logprobs=3, max_tokens=5
        )
    (call,) = await recorded(app)
    content = response.choices[0].logprobs
    assert content is not None and content.content is not None
    assert [t.logprob for t in content.content] == pytest.approx(list(call.response_logprobs), abs=1e-6)
    for token in content.content:
        assert len(token.top_logprobs) == 3
        ranked = [t.logprob for t in token.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert token.logprob <= ranked[0] + 1e-6


async def test_stop_string_ends_the_text_before_it(app: Appliance, active: ActiveRollout) -> None:
    # A seeded call is reproducible: find what the model writes, then stop on a piece of it.
    async with client(app, active) as oai:
        free = await oai.chat.completions.create(model="m", messages=USER, max_tokens=10, seed=1)
    text = free.choices[0].message.content or ""
    assert len(text) >= 4
    stop = text[2:4]
    async with client(app, active) as oai:
        cut = await oai.chat.completions.create(model="m", messages=USER, max_tokens=10, seed=1, stop=[stop])
    calls = await recorded(app)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert calls[-1].finish_reason == "stop"
    assert len(calls[-1].response_ids) <= len(calls[0].response_ids)


async def test_client_disconnect_mid_stream_cancels_and_is_recorded(
    app: Appliance, active: ActiveRollout
) -> None:
    body = {"model": "m", "messages": USER, "stream": True, "max_tokens": 400}
    headers = {"Authorization": f"Bearer {active.token}"}
    url = f"{app.proxy_url}/rollouts/r1/v1/chat/completions"
    before = app.live.position
    async with aiohttp.ClientSession() as http:
        response = await http.post(url, json=body, headers=headers)
        await response.content.readline()  # the first event arrived: generation is under way
        response.close()
    async with asyncio.timeout(30):
        # The cancelled call is recorded once the proxy notices the client is gone.
        await app.live.wait_for(before + 1)
    (call,) = await recorded(app)
    assert call.finish_reason == "cancelled"
    assert len(call.response_ids) < 400
    assert len(call.response_logprobs) == len(call.response_ids)
    # The engine is free again: a new call completes.
    async with client(app, active) as oai:
        again = await oai.chat.completions.create(model="m", messages=USER, max_tokens=3)
    assert again.choices[0].finish_reason in ("stop", "length")


async def test_calls_wait_while_training_holds_the_machine(app: Appliance, active: ActiveRollout) -> None:
    gate = app.runner.gate if app.runner else None
    assert gate is not None
    gate.close()
    async with client(app, active) as oai:
        pending = asyncio.ensure_future(oai.chat.completions.create(model="m", messages=USER, max_tokens=3))
        await asyncio.sleep(0.5)
        assert not pending.done()
        assert await recorded(app) == []
        gate.open()
        response = await asyncio.wait_for(pending, 30)
    assert response.choices[0].message is not None


async def test_tool_calls_stream_and_round_trip_token_exact(app: Appliance, active: ActiveRollout) -> None:
    """Make the engine emit a hermes tool call; the client sees tool_calls (streamed), sends the
    result back, and the two calls merge into one exact sample."""
    tokenizer = app.registry._tokenizer
    scripted = tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    real_generate = app.engine.generate
    turns = 0

    async def scripted_generate(request: GenerateRequest) -> GenerateResult:
        nonlocal turns
        turns += 1
        if turns > 1:
            return await real_generate(request)
        ids = (*scripted, tokenizer.im_end_id)
        if request.on_token is not None:
            for token in ids:
                request.on_token(token, -0.5)
        return GenerateResult(
            token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", policy_version=0
        )

    app.engine.generate = scripted_generate  # type: ignore[method-assign]
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]
    async with client(app, active) as oai:
        stream = await oai.chat.completions.create(model="m", messages=USER, tools=tools, stream=True)
        chunks = [c async for c in stream]
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas if d.function] == ["add"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        call_id = deltas[0].id or new_tool_call_id()
        arguments = (deltas[0].function.arguments if deltas[0].function else None) or "{}"
        assert json.loads(arguments) == {"a": 3, "b": 4}
        messages: list[ChatCompletionMessageParam] = [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "7"},
        ]
        await oai.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=4)
    calls = await recorded(app)
    (sample,) = build_samples(calls)
    sampled = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
    assert sampled == list(calls[0].response_ids) + list(calls[1].response_ids)
    assert calls[1].spliced_tokens == len(calls[0].response_ids)
    assert calls[1].unmatched_assistant_turns == 0


async def post_chat(
    app: Appliance, active: ActiveRollout, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions",
            json={"model": "m", "messages": USER, **body},
            headers={"Authorization": f"Bearer {active.token}"},
        )
        payload: dict[str, Any] = await response.json()
        return response.status, payload


async def test_top_p_zero_keeps_only_the_most_likely_token(app: Appliance, active: ActiveRollout) -> None:
    """OpenAI allows top_p 0: at any temperature and seed it draws what greedy decoding picks."""
    async with client(app, active) as oai:
        for seed in (1, 2):
            await oai.chat.completions.create(model="m", messages=USER, max_tokens=8, top_p=0, seed=seed)
    first, second = await recorded(app)
    assert first.sampling["temperature"] == 1.0 and 0 < first.sampling["top_p"] < 1e-6
    greedy = await app.engine.generate(
        GenerateRequest(
            prompt_ids=first.prompt_ids,
            params=SamplingParams(
                max_tokens=8, temperature=0, stop_token_ids=tuple(first.sampling["stop_token_ids"])
            ),
        )
    )
    assert list(first.response_ids) == list(second.response_ids) == list(greedy.token_ids)


async def test_integral_floats_are_read_as_integers(app: Appliance, active: ActiveRollout) -> None:
    """Some JSON encoders write every number as a float: 1.0 where the spec says integer is 1."""
    status, payload = await post_chat(
        app,
        active,
        {"n": 1.0, "seed": 0.0, "logprobs": True, "top_logprobs": 6.0, "max_completion_tokens": 3.0},
    )
    assert status == 200, payload
    (choice,) = payload["choices"]
    assert all(len(entry["top_logprobs"]) == 6 for entry in choice["logprobs"]["content"])
    assert payload["usage"]["completion_tokens"] <= 3
    status, payload = await post_chat(app, active, {"max_tokens": 2.0})
    assert status == 200, payload
    assert payload["usage"]["completion_tokens"] <= 2
    first, second = await recorded(app)
    assert first.sampling["seed"] == 0 and isinstance(first.sampling["seed"], int)
    assert (first.sampling["max_tokens"], first.sampling["top_logprobs"]) == (3, 6)
    assert second.sampling["max_tokens"] == 2


@pytest.mark.parametrize("field", ["n", "seed", "top_logprobs", "max_tokens", "max_completion_tokens"])
async def test_fractional_integers_are_400s_naming_the_field(
    app: Appliance, active: ActiveRollout, field: str
) -> None:
    status, payload = await post_chat(app, active, {"logprobs": True, field: 1.5})
    assert status == 400
    assert payload["error"]["param"] == field and "1.5" in payload["error"]["message"]


async def test_deprecated_function_message_renders_as_a_tool_result(
    app: Appliance, active: ActiveRollout
) -> None:
    asked: list[ChatCompletionMessageParam] = [*USER, {"role": "assistant", "content": "Let me add."}]
    async with client(app, active) as oai:
        await oai.chat.completions.create(
            model="m",
            messages=[*asked, {"role": "function", "name": "add", "content": "7"}],
            max_tokens=2,
        )
        await oai.chat.completions.create(
            model="m",
            messages=[*asked, {"role": "tool", "tool_call_id": "call_1", "content": "7"}],
            max_tokens=2,
        )
    as_function, as_tool = await recorded(app)
    assert list(as_function.prompt_ids) == list(as_tool.prompt_ids)
    assert "<tool_response>\n7\n</tool_response>" in app.registry._tokenizer.decode(list(as_tool.prompt_ids))


#: The function the deprecated ``functions`` field declares, and the same as a tool.
ADD_FUNCTION: Any = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("logit_bias", {"1": 5}),
    ],
)
async def test_distribution_changing_fields_are_refused(
    app: Appliance, active: ActiveRollout, field: str, value: Any
) -> None:
    """Penalties and logit bias would sample away from the policy the trainer learns from."""
    status, payload = await post_chat(app, active, {field: value})
    assert status == 400, payload
    assert payload["error"]["param"] == field
    assert "not supported" in payload["error"]["message"] and "policy" in payload["error"]["message"]
    assert await recorded(app) == []


async def test_default_penalties_and_bias_are_accepted(app: Appliance, active: ActiveRollout) -> None:
    body = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "max_tokens": 2}
    status, payload = await post_chat(app, active, body)
    assert status == 200, payload


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "yes"),
        ("stream", 0),
        ("stream_options", []),
        ("stream_options", {"include_usage": "yes"}),
        ("tool_choice", "any"),
        ("tool_choice", {"type": "function"}),
        ("tool_choice", {"type": "function", "function": {"name": 3}}),
        ("tool_choice", {"type": "function", "function": {"name": "undeclared"}}),
        ("frequency_penalty", "0"),
        ("logit_bias", [1]),
        ("functions", {"name": "add"}),
        ("function_call", "required"),
    ],
)
async def test_badly_typed_fields_are_400s_naming_the_field(
    app: Appliance, active: ActiveRollout, field: str, value: Any
) -> None:
    status, payload = await post_chat(app, active, {field: value})
    assert status == 400, payload
    assert payload["error"]["param"] == field


async def test_deprecated_functions_render_exactly_as_tools(app: Appliance, active: ActiveRollout) -> None:
    """``functions`` / ``function_call`` are the ``tools`` / ``tool_choice`` they stand for."""
    async with client(app, active) as oai:
        await oai.chat.completions.create(
            model="m", messages=USER, functions=[ADD_FUNCTION], function_call={"name": "add"}, max_tokens=2
        )
        await oai.chat.completions.create(
            model="m",
            messages=USER,
            tools=[{"type": "function", "function": ADD_FUNCTION}],
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=2,
        )
        await oai.chat.completions.create(model="m", messages=USER, max_tokens=2)
        await oai.chat.completions.create(
            model="m", messages=USER, functions=[ADD_FUNCTION], function_call="none", max_tokens=2
        )
    as_functions, as_tools, without, hidden = await recorded(app)
    assert list(as_functions.prompt_ids) == list(as_tools.prompt_ids)
    prompt = app.registry._tokenizer.decode(list(as_functions.prompt_ids))
    assert '"name": "add"' in prompt and "Add two integers." in prompt
    assert list(hidden.prompt_ids) == list(without.prompt_ids)
    status, payload = await post_chat(
        app, active, {"functions": [ADD_FUNCTION], "tools": [{"type": "function", "function": ADD_FUNCTION}]}
    )
    assert status == 400 and payload["error"]["param"] == "functions", payload


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("surface", ["chat", "completions"])
def test_a_streamed_delta_event_is_the_chunk_written_whole(surface: str, usage: bool) -> None:
    """A text delta's event is written from a template (the delta alone is written per event):
    byte for byte the chunk that the dictionary of the same event would give."""
    from appliance.proxy.http import sse_events
    from appliance.proxy.openai_chat import ChatChunks
    from appliance.proxy.openai_completions import CompletionChunks
    from appliance.proxy.pipeline import CallRequest

    request = CallRequest(
        surface=surface, model='m "1"', prompts=(), params=SamplingParams(), body={}, include_usage=usage
    )
    for delta in ("Hello", ' "quoted" \\ \n', "é\U0001f600", "\x00\x01"):
        if surface == "chat":
            chat = ChatChunks(request, "call-1")
            assert sse_events(chat.text(delta)) == sse_events([chat._chunk({"content": delta})])
        else:
            text = CompletionChunks(request, "call-1", None)
            assert sse_events(text.text(delta)) == sse_events([text._chunk(delta)])


async def test_a_calls_event_reaches_live_subscribers_as_it_was_recorded(
    app: Appliance, active: ActiveRollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event a call records holds only what the log reads back (its sampling's stop ids a
    list), so the store hands live subscribers that very object instead of reading its row."""
    appended: list[Event] = []
    append = app.store.append

    async def keep(events: Sequence[Event]) -> list[int]:
        appended.extend(events)
        return await append(events)

    monkeypatch.setattr(app.store, "append", keep)
    after = app.store.last_position
    async with client(app, active) as oai:
        await oai.chat.completions.create(model="m", messages=USER, max_tokens=4, seed=3, temperature=0.5)
    (recorded_event,) = [e for e in appended if isinstance(e, LLMCallCompleted)]
    assert recorded_event.sampling["stop_token_ids"]  # the tokenizer's end of turn, as a list

    async def first_call() -> Event:
        async for stored in app.store.subscribe(after=after):
            if isinstance(stored.event, LLMCallCompleted):
                return stored.event
        raise AssertionError("the store closed")

    live = await asyncio.wait_for(first_call(), 10)
    assert live is recorded_event
    (from_log,) = await recorded(app)
    assert from_log == live
