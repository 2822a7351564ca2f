"""The Responses surface through real clients: the openai SDK (plain, streamed, multi-turn, tools),
raw HTTP for bad input, and an openai-agents ``Agent`` when that package is installed."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from openai.types.responses import FunctionTool, Response

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.rollouts.registry import ActiveRollout
from tests.support import make_config
from tests.support import openai_client as client
from tests.support import recorded_calls as recorded
from trainer.samples import build_samples

ADD_TOOL: Any = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    "strict": False,
}
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=12)) as appliance:
        yield appliance


@pytest.fixture
def active(app: Appliance) -> ActiveRollout:
    return app.registry.register("r1", task_id="t", group="g", task={})


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@contextlib.contextmanager
def script(app: Appliance, tokenizer: Tokenizer, texts: list[str | None]) -> Iterator[None]:
    """Make the engine answer the next calls with these texts (then ``<|im_end|>``); ``None``
    lets the real model sample that call."""
    real_generate = app.engine.generate
    turns = iter(texts)

    async def scripted_generate(request: GenerateRequest) -> GenerateResult:
        text = next(turns, None)
        if text is None:
            return await real_generate(request)
        ids = (*tokenizer.encode(text), tokenizer.im_end_id)
        if request.on_token is not None:
            for token in ids:
                request.on_token(token, -0.5)
        return GenerateResult(
            token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", policy_version=0
        )

    app.engine.generate = scripted_generate  # type: ignore[method-assign]
    try:
        yield
    finally:
        app.engine.generate = real_generate  # type: ignore[method-assign]


def output_text(response: Any) -> str:
    return "".join(
        part.text
        for item in response.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    )


async def test_plain_input_with_instructions(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    async with client(app, active) as oai:
        response = await oai.responses.create(
            model="m", input="What is 1 + 2?", instructions="Answer tersely.", max_output_tokens=6, store=True
        )
    (call,) = await recorded(app)
    assert response.id == "resp_" + call.call_id
    assert response.object == "response"
    assert response.output_text == output_text(response) == call.response_text
    assert response.status == ("incomplete" if call.finish_reason == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.input_tokens == len(call.prompt_ids)
    assert response.usage.output_tokens == len(call.response_ids) <= 6
    assert response.usage.total_tokens == len(call.prompt_ids) + len(call.response_ids)
    assert response.instructions == "Answer tersely."
    assert response.max_output_tokens == 6
    assert call.surface == "openai.responses"
    assert call.request["input"] == "What is 1 + 2?"
    prompt = tokenizer.decode(call.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nAnswer tersely.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")


async def test_streamed_deltas_add_up_to_the_recorded_text(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        stream = await oai.responses.create(
            model="m", input="Count to five.", max_output_tokens=10, stream=True
        )
        events = [event async for event in stream]
    (call,) = await recorded(app)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    terminal = "response.incomplete" if call.finish_reason == "length" else "response.completed"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == terminal
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.text == output_text(final) == call.response_text
    assert final.id == "resp_" + call.call_id
    assert final.usage is not None
    assert final.usage.output_tokens == len(call.response_ids)
    assert 0 < call.ttft_s <= call.total_s


async def test_stream_helper_gets_the_final_response(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    with script(app, tokenizer, ["Seven."]):
        async with (
            client(app, active) as oai,
            oai.responses.stream(model="m", input="What is 3 + 4?") as stream,
        ):
            texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    (call,) = await recorded(app)
    assert "".join(texts) == final.output_text == call.response_text == "Seven."
    assert final.status == "completed"
    assert final.incomplete_details is None


async def test_multi_turn_resending_output_splices_token_exact(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        first = await oai.responses.create(
            model="m", input=[{"role": "user", "content": "What is 1 + 2?"}], max_output_tokens=6
        )
        history: list[Any] = [
            {"role": "user", "content": "What is 1 + 2?"},
            *[item.to_dict() for item in first.output],
            {"role": "user", "content": [{"type": "input_text", "text": "And 2 + 2?"}]},
        ]
        await oai.responses.create(model="m", input=history, max_output_tokens=6)
    one, two = await recorded(app)
    prefix = [*one.prompt_ids, *one.response_ids]
    assert list(two.prompt_ids[: len(prefix)]) == prefix
    assert two.spliced_tokens == len(one.response_ids)
    assert two.unmatched_assistant_turns == 0


async def test_a_stateless_conversation_is_read_from_where_its_last_input_ended(
    app: Appliance, active: ActiveRollout, whole_reads: list[bytes]
) -> None:
    history: list[Any] = []
    async with client(app, active) as oai:
        for turn in range(4):
            history.append({"role": "user", "content": f"What is {turn} + 2?"})
            answer = await oai.responses.create(model="m", input=history, max_output_tokens=6, store=False)
            history += [item.to_dict() for item in answer.output]
    assert len(whole_reads) == 1  # the first body; each later one from where the one before ended
    calls = await recorded(app)
    assert [call.request["input"] for call in calls] == [history[: 2 * n + 1] for n in range(4)]
    assert all(call.spliced_tokens > 0 and call.unmatched_assistant_turns == 0 for call in calls[1:])


async def test_tool_calls_round_trip_token_exact(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    """A sampled tool call (with text before it) streams as a message and a function_call item;
    re-sent with its output, the two calls make one exact sample."""
    user: Any = {"role": "user", "content": "What is 3 + 4?"}
    with script(app, tokenizer, [" Let me add.\n" + TOOL_CALL, None]):
        async with client(app, active) as oai:
            stream = await oai.responses.create(model="m", input=[user], tools=[ADD_TOOL], stream=True)
            events: list[Any] = [e async for e in stream]
            final = events[-1].response
            assert events[-1].type == "response.completed"
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            # The text keeps its leading space (as sampled) and loses the newline before the call.
            assert deltas == final.output_text == " Let me add."
            message, function_call = cast(list[Any], final.output)
            assert message.type == "message" and function_call.type == "function_call"
            assert function_call.name == "add"
            assert json.loads(function_call.arguments) == {"a": 3, "b": 4}
            (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert args_done.arguments == function_call.arguments
            history: list[Any] = [
                user,
                *[item.to_dict() for item in final.output],
                {"type": "function_call_output", "call_id": function_call.call_id, "output": "7"},
            ]
            await oai.responses.create(model="m", input=history, tools=[ADD_TOOL], max_output_tokens=4)
    one, two = await recorded(app)
    assert list(two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)]) == [
        *one.prompt_ids,
        *one.response_ids,
    ]
    assert two.unmatched_assistant_turns == 0
    (sample,) = build_samples([one, two])
    sampled = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
    assert sampled == [*one.response_ids, *two.response_ids]


async def test_function_call_items_render_into_the_prompt(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    history: list[Any] = [
        {"type": "message", "role": "developer", "content": "Use tools."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 3, "b": 4}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 1, "b": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "7"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ]
    async with client(app, active) as oai:
        await oai.responses.create(model="m", input=history, tools=[ADD_TOOL], max_output_tokens=3)
    (call,) = await recorded(app)
    prompt = tokenizer.decode(call.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert '"name": "add", "description": "Add two integers."' in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call><|im_end|>\n'
    ) in prompt
    assert (
        "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>"
        in prompt
    )


GOOD: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        ({"input": "hi"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": [{"role": "wizard", "content": "x"}]}, "input[0]"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content",
        ),
        ({"model": "m", "input": [{"type": "web_search_call", "id": "ws"}]}, "input[0]"),
        ({"model": "m", "input": [{"type": "function_call", "name": "add"}]}, "input[0]"),
        ({**GOOD, "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({**GOOD, "tools": [{"type": "function"}]}, "tools[0]"),
        ({**GOOD, "tool_choice": "sometimes"}, "tool_choice"),
        ({**GOOD, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({**GOOD, "tools": [{"type": "function", "name": "add", "strict": "yes"}]}, "tools[0]"),
        ({**GOOD, "tools": [{"type": "function", "name": "add", "parameters": []}]}, "tools[0]"),
        ({**GOOD, "previous_response_id": "resp_123"}, "previous_response_id"),
        ({**GOOD, "previous_response_id": 123}, "previous_response_id"),
        ({**GOOD, "store": "yes"}, "store"),
        ({**GOOD, "conversation": "conv_1"}, "conversation"),
        ({**GOOD, "instructions": 3}, "instructions"),
        ({**GOOD, "temperature": 9}, "temperature"),
        ({**GOOD, "max_output_tokens": 0}, "max_output_tokens"),
        ({**GOOD, "stream": "yes"}, "stream"),
        ({**GOOD, "text": {"format": {"type": "yaml"}}}, "text"),
    ],
)
async def test_bad_input_gets_an_openai_error_and_nothing_is_recorded(
    app: Appliance, active: ActiveRollout, body: Any, param: str | None
) -> None:
    headers = {"Authorization": f"Bearer {active.token}", "Content-Type": "application/json"}
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/responses"
    async with aiohttp.ClientSession() as http:
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        response = await http.post(url, headers=headers, **kwargs)
        payload = await response.json()
        assert response.status == 400, payload
        assert set(payload["error"]) >= {"message", "type", "param", "code"}
        assert payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["message"]
        assert payload["error"]["param"] == param
        if body == {**GOOD, "previous_response_id": "resp_123"}:
            assert payload["error"]["code"] == "previous_response_not_found"
        # The appliance keeps serving after the bad request.
        again = await http.post(url, headers=headers, json=GOOD)
        assert again.status == 200, await again.text()
    assert len(await recorded(app)) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("truncation", "sideways"),
        ("truncation", True),
        ("user", 5),
        ("metadata", {"k": 1}),
        ("metadata", {"k" * 65: "v"}),
        ("metadata", {"k": "v" * 513}),
        ("metadata", {f"k{i}": "v" for i in range(17)}),
        ("metadata", ["k", "v"]),
        ("text", {"format": {"type": "json_schema", "name": "n", "schema": {}, "description": 5}}),
    ],
)
async def test_a_field_the_response_repeats_is_validated(
    app: Appliance, active: ActiveRollout, field: str, value: Any
) -> None:
    """What the response object echoes back must be what the SDK's ``Response`` model accepts:
    an out-of-range value is a 400 naming the field, not a 200 the client cannot parse."""
    headers = {"Authorization": f"Bearer {active.token}"}
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/responses"
    async with aiohttp.ClientSession() as http:
        response = await http.post(url, headers=headers, json={**GOOD, field: value})
        payload = await response.json()
    assert response.status == 400, payload
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["param"] == field
    assert await recorded(app) == []


async def test_repeated_fields_in_range_are_echoed_as_the_sdk_reads_them(
    app: Appliance, active: ActiveRollout
) -> None:
    echoed = {
        "truncation": "auto",
        "user": "u-1",
        "metadata": {"k" * 64: "v" * 512, **{f"k{i}": "v" for i in range(15)}},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "description": "d"}},
    }
    headers = {"Authorization": f"Bearer {active.token}"}
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/responses"
    async with aiohttp.ClientSession() as http:
        response = await http.post(url, headers=headers, json={**GOOD, **echoed})
        payload = await response.json()
    assert response.status == 200, payload
    parsed = Response.model_validate(payload)
    assert (parsed.truncation, parsed.user, parsed.metadata) == ("auto", "u-1", echoed["metadata"])


async def test_wrong_token_is_refused(app: Appliance, active: ActiveRollout) -> None:
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/responses"
    async with aiohttp.ClientSession() as http:
        response = await http.post(url, json=GOOD, headers={"Authorization": "Bearer wrong"})
        payload = await response.json()
    assert response.status == 401
    assert payload["error"]["type"] == "authentication_error"
    assert await recorded(app) == []


async def test_an_error_after_the_stream_started_is_an_error_event(
    app: Appliance, active: ActiveRollout
) -> None:
    gate = app.runner.gate if app.runner else None
    assert gate is not None
    gate.hold_timeout_s = 0.2
    gate.close()  # training holds the machine past the limit: the call fails after the stream began
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/responses"
    headers = {"Authorization": f"Bearer {active.token}"}
    async with aiohttp.ClientSession() as http:
        response = await http.post(url, json={**GOOD, "stream": True}, headers=headers)
        assert response.status == 200
        body = await response.text()
        gate.open()
        again = await http.post(url, json=GOOD, headers=headers)
        assert again.status == 200
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == "engine_unavailable"
    assert events[-1]["sequence_number"] == 2
    assert len(await recorded(app)) == 1


HAS_AGENTS = importlib.util.find_spec("agents") is not None


@pytest.mark.skipif(not HAS_AGENTS, reason="openai-agents is not installed (pip install openai-agents)")
@pytest.mark.parametrize("streamed", [False, True])
async def test_openai_agents_runs_a_tool_loop(
    app: Appliance,
    active: ActiveRollout,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    streamed: bool,
) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async with client(app, active) as oai:
        agent = Agent(
            name="adder",
            instructions="Use the add tool.",
            model=OpenAIResponsesModel(model="m", openai_client=oai),
            tools=[add],
        )
        with script(app, tokenizer, [TOOL_CALL, "It is 7."]):
            if streamed:
                run = Runner.run_streamed(agent, "What is 3 + 4?")
                async for _event in run.stream_events():
                    pass
                final = run.final_output
            else:
                final = (await Runner.run(agent, "What is 3 + 4?")).final_output
    assert final == "It is 7."
    one, two = await recorded(app)
    assert one.surface == two.surface == "openai.responses"
    assert list(two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)]) == [
        *one.prompt_ids,
        *one.response_ids,
    ]
    assert "<tool_response>\n7\n</tool_response>" in tokenizer.decode(two.prompt_ids)
    (sample,) = build_samples([one, two])
    assert sum(sample.loss_mask) == len(one.response_ids) + len(two.response_ids)


async def test_tools_come_back_as_function_tools(app: Appliance, active: ActiveRollout) -> None:
    """The response lists each tool in the Responses API's ``FunctionTool`` shape (``strict``
    defaults to true), not the request's object echoed with whatever else it carried."""
    bare = {"type": "function", "name": "now", "x-vendor": 1}
    async with client(app, active) as oai:
        response = await oai.responses.create(
            model="m", input="hi", tools=[ADD_TOOL, cast(Any, bare)], max_output_tokens=2
        )
    add, now = response.tools
    assert isinstance(add, FunctionTool) and isinstance(now, FunctionTool)
    assert add.model_dump(exclude_unset=True) == ADD_TOOL
    raw = response.model_dump(mode="json", exclude_unset=True)["tools"][1]
    assert raw == {"type": "function", "name": "now", "parameters": None, "strict": True}
    assert FunctionTool.model_validate(raw) == now


@pytest.mark.parametrize("stream", [False, True])
async def test_include_output_text_logprobs_returns_the_sampled_logprobs(
    app: Appliance, active: ActiveRollout, stream: bool
) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the output text part
    carries each sampled token's log-prob (the ones recorded) and its alternatives."""
    kwargs: dict[str, Any] = {
        "model": "m",
        "input": "Count: 1, 2,",
        "max_output_tokens": 6,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    async with client(app, active) as oai:
        if stream:
            events = [e async for e in await oai.responses.create(**kwargs, stream=True)]
            done = [e for e in events if e.type == "response.output_text.done"]
            assert len(done) == 1
            streamed = [(lp.token, lp.logprob) for lp in done[0].logprobs]
            final = [e for e in events if e.type in ("response.completed", "response.incomplete")]
            response = final[-1].response
        else:
            response = await oai.responses.create(**kwargs)
        assert response.top_logprobs == 2
    message = next(item for item in response.output if item.type == "message")
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs is not None
    (call,) = await recorded(app)
    assert [lp.logprob for lp in part.logprobs] == pytest.approx(list(call.response_logprobs), abs=1e-6)
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    if stream:
        assert streamed == [(lp.token, lp.logprob) for lp in part.logprobs]
    # Without ``include`` nothing is returned, as OpenAI answers.
    async with client(app, active) as oai:
        plain = await oai.responses.create(model="m", input="Count:", max_output_tokens=3, top_logprobs=2)
    item = next(i for i in plain.output if i.type == "message")
    assert item.content[0].type == "output_text" and not item.content[0].logprobs
