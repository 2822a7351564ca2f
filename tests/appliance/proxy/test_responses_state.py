"""Stored responses through the openai SDK: ``store`` (on by default), ``GET /v1/responses/{id}``,
its ``input_items``, ``previous_response_id`` chains spliced token for token, ``DELETE``, and
that all of it is read from the rollout's own events (another rollout gets a 404; a restarted
appliance on the same store still answers)."""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import openai
import pytest

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from appliance.rollouts.registry import ActiveRollout
from store.events import ResponseDeleted, ResponseStored
from tests.appliance.proxy.test_responses import ADD_TOOL, TOOL_CALL, script
from tests.support import make_config
from tests.support import openai_client as client
from tests.support import recorded_calls as recorded
from trainer.samples import build_samples

HAS_AGENTS = importlib.util.find_spec("agents") is not None


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


async def listed(oai: openai.AsyncOpenAI, response_id: str, **query: Any) -> Any:
    """A page of a response's input items (typed loosely: the items are a union of 30 types)."""
    return await oai.responses.input_items.list(response_id, **query)


async def stored_events(app: Appliance) -> list[Any]:
    kinds = {ResponseStored.type, ResponseDeleted.type}
    return [s.event for s in await app.store.read(types=kinds)]


async def test_a_response_is_stored_by_default_and_retrieved_as_answered(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    with script(app, tokenizer, ["Three.", "Four."]):
        async with client(app, active) as oai:
            created = await oai.responses.create(
                model="m", input="What is 1 + 2?", instructions="Be terse.", max_output_tokens=6
            )
            retrieved = await oai.responses.retrieve(created.id)
            stream = await oai.responses.create(model="m", input="And 2 + 2?", stream=True)
            final = cast(Any, [e async for e in stream][-1]).response
            retrieved_final = await oai.responses.retrieve(final.id)
    assert retrieved.model_dump() == created.model_dump()
    assert retrieved.output_text == "Three." and retrieved.instructions == "Be terse."
    assert retrieved_final.model_dump() == final.model_dump()
    assert retrieved_final.output_text == "Four."
    one, two = await stored_events(app)
    assert (one.rollout, one.response["id"], two.response["id"]) == ("r1", created.id, final.id)


async def test_input_items_list_newest_first_and_paginate(app: Appliance, active: ActiveRollout) -> None:
    history: Any = [
        {"type": "message", "role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is 3 + 4?"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 3, "b": 4}'},
        {"type": "function_call_output", "call_id": "c1", "output": "7", "id": "fco_mine"},
    ]
    async with client(app, active) as oai:
        response = await oai.responses.create(model="m", input=history, tools=[ADD_TOOL], max_output_tokens=3)
        newest_first = await listed(oai, response.id)
        oldest_first = await listed(oai, response.id, order="asc")
        page = await listed(oai, response.id, order="asc", limit=3)
        rest = await listed(oai, response.id, order="asc", limit=3, after=page.last_id)
        pages = oai.responses.input_items.list(response.id, limit=1)
        walked = [cast(Any, item).id async for item in pages]
    kinds = [(item.type, getattr(item, "role", None)) for item in oldest_first.data]
    assert kinds == [
        ("message", "developer"),
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
    ]
    ids = [item.id for item in oldest_first.data]
    assert len(set(ids)) == 4 and ids[3] == "fco_mine"
    assert [item.id for item in newest_first.data] == ids[::-1]
    assert (newest_first.first_id, newest_first.last_id, newest_first.has_more) == (ids[3], ids[0], False)
    first, second = oldest_first.data[:2]
    assert first.content[0].text == "Use tools." and first.content[0].type == "input_text"
    assert second.content[0].text == "What is 3 + 4?"
    assert [item.id for item in page.data] == ids[:3] and page.has_more
    assert [item.id for item in rest.data] == ids[3:] and not rest.has_more
    assert walked == ids[::-1]


async def test_previous_response_id_chains_turns_token_exact(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    """Three turns, each sending only what is new: the stored output (text and a tool call) is
    continued exactly as it was sampled, so the three calls make one sample."""
    with script(app, tokenizer, [" Let me add.\n" + TOOL_CALL, "It is 7.", None]):
        async with client(app, active) as oai:
            one = await oai.responses.create(
                model="m", input="What is 3 + 4?", instructions="Use tools.", tools=[ADD_TOOL]
            )
            (call,) = [item for item in one.output if item.type == "function_call"]
            output: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "7"}
            two = await oai.responses.create(
                model="m",
                input=[output],
                previous_response_id=one.id,
                instructions="Use tools.",
                tools=[ADD_TOOL],
            )
            three = await oai.responses.create(
                model="m",
                input="Thanks! And 1 + 1?",
                previous_response_id=two.id,
                instructions="Use tools.",
                tools=[ADD_TOOL],
                max_output_tokens=4,
            )
            items = await listed(oai, three.id, order="asc")
    assert two.previous_response_id == one.id and three.previous_response_id == two.id
    first, second, third = await recorded(app)
    for earlier, later in ((first, second), (second, third)):
        prefix = [*earlier.prompt_ids, *earlier.response_ids]
        assert list(later.prompt_ids[: len(prefix)]) == prefix
        assert later.unmatched_assistant_turns == 0
        assert later.request["previous_response_id"] == ("resp_" + earlier.call_id)
    assert third.spliced_tokens == len(first.response_ids) + len(second.response_ids)
    (sample,) = build_samples([first, second, third])
    sampled = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
    assert sampled == [*first.response_ids, *second.response_ids, *third.response_ids]
    # The input items of the third response: every turn's input and output, in order.
    kinds = [item.type for item in items.data]
    assert kinds == ["message", "message", "function_call", "function_call_output", "message", "message"]
    assert items.data[-1].content[0].text == "Thanks! And 1 + 1?"
    assert json.loads(items.data[2].arguments) == {"a": 3, "b": 4}


async def test_instructions_are_not_carried_over(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    with script(app, tokenizer, ["Hi.", "Bye."]):
        async with client(app, active) as oai:
            one = await oai.responses.create(model="m", input="Hello", instructions="Speak French.")
            two = await oai.responses.create(model="m", input="Goodbye", previous_response_id=one.id)
    assert two.instructions is None
    _, second = await recorded(app)
    prompt = tokenizer.decode(second.prompt_ids)
    assert "Speak French." not in prompt
    assert "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>user\nGoodbye<|im_end|>\n<|im_start|>assistant\n")


async def test_a_deleted_response_is_gone_but_its_successors_keep_their_context(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer
) -> None:
    with script(app, tokenizer, ["One.", "Two."]):
        async with client(app, active) as oai:
            one = await oai.responses.create(model="m", input="Count.")
            two = await oai.responses.create(model="m", input="More.", previous_response_id=one.id)
            deleted = await oai.responses.with_raw_response.delete(one.id)
            assert deleted.status_code == 200
            assert json.loads(deleted.content) == {"id": one.id, "object": "response", "deleted": True}
            with pytest.raises(openai.NotFoundError) as gone:
                await oai.responses.retrieve(one.id)
            assert gone.value.status_code == 404
            assert cast(Any, gone.value.body)["code"] == "not_found"
            assert one.id in cast(Any, gone.value.body)["message"]
            with pytest.raises(openai.NotFoundError):
                await listed(oai, one.id)
            with pytest.raises(openai.NotFoundError):
                await oai.responses.delete(one.id)
            with pytest.raises(openai.BadRequestError) as refused:
                await oai.responses.create(model="m", input="Again.", previous_response_id=one.id)
            items = await listed(oai, two.id, order="asc")
    assert refused.value.body == {  # OpenAI's answer for a previous response it does not have
        "message": f"Previous response with id '{one.id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert [getattr(item, "role", None) for item in items.data] == ["user", "assistant", "user"]
    assert len(await recorded(app)) == 2


async def test_store_false_is_not_retrievable(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        response = await oai.responses.create(model="m", input="Hi", store=False, max_output_tokens=3)
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(response.id)
        with pytest.raises(openai.BadRequestError) as refused:
            await oai.responses.create(model="m", input="Hi", previous_response_id=response.id)
    assert cast(Any, refused.value.body)["code"] == "previous_response_not_found"
    assert await stored_events(app) == []
    assert len(await recorded(app)) == 1


async def test_a_rollout_never_reads_another_rollouts_responses(
    app: Appliance, active: ActiveRollout
) -> None:
    other = app.registry.register("r2", task_id="t", group="g", task={})
    async with client(app, active) as mine, client(app, other) as theirs:
        response = await mine.responses.create(model="m", input="Secret.", max_output_tokens=3)
        with pytest.raises(openai.NotFoundError) as hidden:
            await theirs.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await listed(theirs, response.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.delete(response.id)
        with pytest.raises(openai.BadRequestError):
            await theirs.responses.create(model="m", input="Go on.", previous_response_id=response.id)
        assert (await mine.responses.retrieve(response.id)).id == response.id
    assert hidden.value.body == {
        "message": f"Response with id '{response.id}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }


async def test_stored_responses_survive_a_restart(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_tokens=4)
    async with Appliance(config) as app:
        active = app.registry.register("r1", task_id="t", group="g", task={})
        async with client(app, active) as oai:
            one = await oai.responses.create(model="m", input="Remember me.")
            items = await listed(oai, one.id)
    async with Appliance(config) as app:
        active = app.registry.register("r1", task_id="t", group="g", task={})
        async with client(app, active) as oai:
            again = await oai.responses.retrieve(one.id)
            items_again = await listed(oai, one.id)
            two = await oai.responses.create(model="m", input="Go on.", previous_response_id=one.id)
        (_, second) = await recorded(app)
    assert again.model_dump() == one.model_dump()
    assert items_again.model_dump() == items.model_dump()
    assert two.previous_response_id == one.id
    assert second.request["previous_response_id"] == one.id


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/{id}?stream=true", "stream"),
        ("/{id}/input_items?order=sideways", "order"),
        ("/{id}/input_items?limit=0", "limit"),
        ("/{id}/input_items?limit=101", "limit"),
        # Digits str.isdigit() takes and int() refuses, and more digits than int() reads.
        ("/{id}/input_items?limit=%C2%B2", "limit"),
        ("/{id}/input_items?limit=%E2%91%A0", "limit"),
        ("/{id}/input_items?limit=" + "9" * 4301, "limit"),
        ("/{id}/input_items?after=nope", "after"),
    ],
)
async def test_bad_reads_get_an_openai_error(
    app: Appliance, active: ActiveRollout, path: str, param: str
) -> None:
    async with client(app, active) as oai:
        response = await oai.responses.create(model="m", input="Hi", max_output_tokens=2)
    headers = {"Authorization": f"Bearer {active.token}"}
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/responses" + path.format(id=response.id)
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as answer:
        payload = await answer.json()
    assert answer.status == 400, payload
    assert payload["error"]["param"] == param
    assert payload["error"]["type"] == "invalid_request_error"


@pytest.mark.skipif(not HAS_AGENTS, reason="openai-agents is not installed (pip install openai-agents)")
async def test_openai_agents_chains_runs_with_previous_response_id(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """openai-agents, given ``previous_response_id``, sends only the new items on every call of
    the run (tool outputs included): four calls, one exact sample."""
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
        with script(app, tokenizer, [TOOL_CALL, "It is 7.", TOOL_CALL, "Still 7."]):
            first = await Runner.run(agent, "What is 3 + 4?", previous_response_id=None)
            second = await Runner.run(agent, "Check it again.", previous_response_id=first.last_response_id)
    assert (first.final_output, second.final_output) == ("It is 7.", "Still 7.")
    calls = await recorded(app)
    assert len(calls) == 4
    for earlier, later in itertools.pairwise(calls):
        prefix = [*earlier.prompt_ids, *earlier.response_ids]
        assert list(later.prompt_ids[: len(prefix)]) == prefix
        assert later.unmatched_assistant_turns == 0
    # The second run continues the first's last response, then its own: one new item each.
    for earlier, later in itertools.pairwise(calls[1:]):
        assert later.request["previous_response_id"] == "resp_" + earlier.call_id
        assert len(later.request["input"]) == 1
    (sample,) = build_samples(calls)
    assert sum(sample.loss_mask) == sum(len(call.response_ids) for call in calls)
