"""Histories a harness rewrote: a stop string re-appended, a truncated tool call dropped, few-shot
turns never sampled. Each is matched to what was sampled (exact ids spliced) or reported with
its reason, through the real proxy and the trainer's merge rule."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult
from store.events import LLMCallCompleted
from tests.support import make_config, openai_client, recorded_calls, register_rollout
from trainer.samples import build_samples

LOGPROB = -0.25
CODE_STOPS = ["Observation:", "Calling tools:", "</code>"]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


class ScriptedEngine:
    """Each call samples the next id list given to ``script`` (cut at ``max_tokens``)."""

    def __init__(self) -> None:
        self.answers: list[list[int]] = []

    def script(self, *answers: Sequence[int]) -> None:
        self.answers = [list(a) for a in answers]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        full = self.answers.pop(0)
        ids = full[: request.params.max_tokens]
        for token in ids:
            if request.on_token is not None:
                request.on_token(token, LOGPROB)
            await asyncio.sleep(0)
        finish = "stop" if ids == full and ids[-1] in request.params.stop_token_ids else "length"
        return GenerateResult(
            token_ids=tuple(ids), logprobs=(LOGPROB,) * len(ids), finish_reason=finish, policy_version=0
        )


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=64)) as appliance:
        yield appliance


@pytest.fixture
def engine(app: Appliance, monkeypatch: pytest.MonkeyPatch) -> ScriptedEngine:
    scripted = ScriptedEngine()
    monkeypatch.setattr(app.engine, "generate", scripted.generate)
    return scripted


@pytest.fixture
def tokenizer(app: Appliance) -> Tokenizer:
    return app.registry._tokenizer


async def chat(app: Appliance, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """One call of rollout ``r1`` (registered at its first call); the returned text."""
    active = app.registry._active.get("r1") or register_rollout(app)
    async with openai_client(app, active) as oai:
        reply = await oai.chat.completions.create(model="m", messages=messages, **kwargs)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def text_part(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


def trained(sample_tokens: Sequence[int], mask: Sequence[int]) -> list[int]:
    return [t for t, m in zip(sample_tokens, mask, strict=True) if m]


async def test_code_agent_turn_with_its_stop_string_reappended_continues_the_sample(
    app: Appliance, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    """smolagents' CodeAgent: the answer is cut before ``</code>`` and the harness writes it back
    with ``</code>`` appended. The model sampled ``</code>``: every sampled id is spliced, and the
    two calls are one token sequence for the trainer."""
    code = "Thought: add them\n<code>\nprint(1 + 1)\n"
    first_ids = [*tokenizer.encode(code), *tokenizer.encode("</code>"), *tokenizer.encode("\nObservation:")]
    engine.script([*first_ids, tokenizer.im_end_id], [*tokenizer.encode("Done"), tokenizer.im_end_id])
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Write code."},
        {"role": "user", "content": "1 + 1?"},
    ]
    returned = await chat(app, history, stop=CODE_STOPS)
    assert returned == code
    rewritten = (returned + "</code>").strip()  # what smolagents' memory sends back
    follow = [
        *history,
        {"role": "assistant", "content": text_part(rewritten)},
        {"role": "user", "content": "2"},
    ]
    await chat(app, follow, stop=CODE_STOPS)

    one, two = await recorded_calls(app)
    assert one.stop_sequence == "</code>"
    assert tokenizer.decode(one.response_ids) == code + "</code>"
    assert two.unmatched_assistant_turns == 0
    assert two.assistant_turns == (
        {"message": 2, "kind": "stop", "reason": "the returned text + its stop string '</code>'",
         "spliced": len(one.response_ids), "sampled": len(one.response_ids)},
    )  # fmt: skip
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
    (sample,) = build_samples([one, two])
    assert sample.tokens == two.prompt_ids + two.response_ids
    assert trained(sample.tokens, sample.loss_mask) == [*one.response_ids, *two.response_ids]


async def test_stop_string_inside_the_last_sampled_token_splices_the_ids_before_it(
    app: Appliance, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    """The stop string ends inside the last sampled token (``">\\n"``): the ids before it are
    spliced and the stop's ``">"`` is tokenized, so the prompt says exactly what the harness sent;
    the call's own sample still trains every sampled token, and the next call starts a new one."""
    code = "Thought: x\n<code>\nprint(2)\n"
    first_ids = tokenizer.encode(code + "</code>\nObservation:")
    closing = tokenizer.encode("</code>\n")
    assert tokenizer.decode(closing[-1:]) == ">\n"  # the tiny tokenizer merges ">\n"
    engine.script([*first_ids, tokenizer.im_end_id], [*tokenizer.encode("ok"), tokenizer.im_end_id])
    history = [{"role": "user", "content": "print 2"}]
    returned = await chat(app, history, stop=CODE_STOPS)
    assert returned == code
    follow = [
        *history,
        {"role": "assistant", "content": returned + "</code>"},
        {"role": "user", "content": "2"},
    ]
    await chat(app, follow, stop=CODE_STOPS)

    one, two = await recorded_calls(app)
    n = len(one.response_ids)
    assert tokenizer.decode(one.response_ids) == code + "</code>\n"
    (turn,) = two.assistant_turns
    assert (turn["kind"], turn["spliced"], turn["sampled"]) == ("stop", n - 1, n)
    start = len(one.prompt_ids)
    assert two.prompt_ids[start : start + n - 1] == one.response_ids[:-1]
    assert list(two.prompt_ids[start + n - 1 : start + n + 1]) == [
        *tokenizer.encode(">"),
        tokenizer.im_end_id,
    ]
    first, second = build_samples([one, two])
    assert trained(first.tokens, first.loss_mask) == list(one.response_ids)
    assert second.tokens[: start + n - 1] == one.prompt_ids + one.response_ids[:-1]


async def test_code_agent_turn_with_its_tool_call_text_appended_continues_the_sample(
    app: Appliance, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    """smolagents 1.26 merges its "Calling tools:" message into the assistant turn after the code
    and ``</code>``: the sampled ids (``">\n"`` included, the turn goes on with a newline) are
    spliced, the harness's text after them is prompt, and the sample continues."""
    code = "Thought: x\n<code>\nprint(6 * 7)\n"
    first_ids = tokenizer.encode(code + "</code>\nObservation:")
    engine.script([*first_ids, tokenizer.im_end_id], [*tokenizer.encode("42"), tokenizer.im_end_id])
    history: list[dict[str, Any]] = [{"role": "user", "content": text_part("New task:\n6 * 7?")}]
    returned = await chat(app, history, stop=CODE_STOPS)
    calling = "Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': " + (
        "{'name': 'python_interpreter', 'arguments': 'print(6 * 7)'}}]"
    )
    turn = (returned + "</code>").strip() + "\n" + calling
    follow = [
        *history,
        {"role": "assistant", "content": text_part(turn)},
        {"role": "user", "content": "Observation:\n42"},
    ]
    await chat(app, follow, stop=CODE_STOPS)

    one, two = await recorded_calls(app)
    n = len(one.response_ids)
    (match,) = two.assistant_turns
    assert (match["kind"], match["spliced"], match["sampled"]) == ("stop", n, n)
    (sample,) = build_samples([one, two])
    assert trained(sample.tokens, sample.loss_mask) == [*one.response_ids, *two.response_ids]
    assert tokenizer.decode(sample.tokens).count(calling) == 1


async def test_a_dropped_truncated_tool_call_keeps_the_sampled_ids_of_the_text_before_it(
    app: Appliance, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    """pydantic-ai: the length limit cut a tool call; the harness sends the turn back with its
    text only. The ids of that text are spliced exactly; the cut-off call's ids stay trained in
    the first call's sample."""
    text = "I will add them."
    cut = tokenizer.encode('\n<tool_call>\n{"name": "add", "arguments": {"a": 1')
    sampled = [*tokenizer.encode(text), *cut]
    engine.script(sampled, [*tokenizer.encode("3"), tokenizer.im_end_id])
    history = [{"role": "user", "content": "add 1 and 2"}]
    await chat(app, history, tools=[ADD], max_tokens=len(sampled))
    follow = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    await chat(app, follow, tools=[ADD], max_tokens=8)

    one, two = await recorded_calls(app)
    assert one.finish_reason == "length"
    k = len(tokenizer.encode(text))
    (turn,) = two.assistant_turns
    assert (turn["kind"], turn["spliced"], turn["sampled"]) == ("prefix", k, len(sampled))
    assert two.unmatched_assistant_turns == 0
    start = len(one.prompt_ids)
    assert two.prompt_ids[: start + k + 1] == (*one.prompt_ids, *sampled[:k], tokenizer.im_end_id)
    first, second = build_samples([one, two])
    assert trained(first.tokens, first.loss_mask) == sampled
    assert second.tokens[: start + k] == one.prompt_ids + tuple(sampled[:k])


async def test_re_serialised_arguments_and_a_dropped_cut_call_splice_the_returned_turn(
    app: Appliance, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    """pydantic-ai 2.68, recorded: a second tool call is cut by the length limit (the proxy returns
    the first), and the harness sends the first back with its arguments re-serialised
    (``{"query":"x"}``). The sampled ids up to the end of the first call are spliced; the cut
    call's ids stay trained in the first call's sample only."""
    block = '\n<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'
    kept = [*tokenizer.encode("Let me search."), *tokenizer.encode(block)]
    sampled = [*kept, *tokenizer.encode('\n<tool_call>\n{"name": "search", "arguments": {"query": "Fr')]
    engine.script(sampled, [*tokenizer.encode("Paris."), tokenizer.im_end_id])
    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    history: list[dict[str, Any]] = [{"role": "user", "content": "What is the capital of France?"}]
    async with openai_client(app, register_rollout(app)) as oai:
        reply = await oai.chat.completions.create(
            model="m",
            messages=history,  # type: ignore[arg-type]
            tools=[search],  # type: ignore[list-item]
            max_completion_tokens=len(sampled),
        )
    (call,) = reply.choices[0].message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.arguments == '{"query": "capital of France"}'
    sent = {
        "id": call.id,
        "type": "function",
        "function": {"name": "search", "arguments": '{"query":"capital of France"}'},
    }
    follow = [
        *history,
        {"role": "assistant", "content": "Let me search.", "tool_calls": [sent]},
        {"role": "tool", "tool_call_id": call.id, "content": "Paris is the capital of France."},
    ]
    await chat(app, follow, tools=[search])

    one, two = await recorded_calls(app)
    (turn,) = two.assistant_turns
    assert (turn["kind"], turn["spliced"], turn["sampled"]) == ("arguments", len(kept), len(sampled))
    assert two.unmatched_assistant_turns == 0
    start = len(one.prompt_ids)
    assert two.prompt_ids[: start + len(kept) + 1] == (*one.prompt_ids, *kept, tokenizer.im_end_id)
    first, second = build_samples([one, two])
    assert trained(first.tokens, first.loss_mask) == sampled
    assert trained(second.tokens, second.loss_mask) == list(two.response_ids)


async def test_few_shot_and_rewritten_turns_are_reported_with_their_reason(
    app: Appliance, engine: ScriptedEngine, tokenizer: Tokenizer
) -> None:
    """aider's few-shot assistant turns were never sampled; a turn whose text the harness changed
    differs at a character; a tool call whose arguments were changed differs there."""
    engine.script(
        [*tokenizer.encode("Sure."), tokenizer.im_end_id],
        [
            *tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
            tokenizer.im_end_id,
        ],
        [*tokenizer.encode("3"), tokenizer.im_end_id],
    )
    shots = [
        {"role": "system", "content": "You edit code."},
        {"role": "user", "content": "Change get_factorial() to use math.factorial"},
        {"role": "assistant", "content": "To make this change we need to modify `mathweb/flask/app.py`."},
        {"role": "user", "content": "Fix the bug."},
    ]
    await chat(app, shots, tools=[ADD])
    rewritten = [
        *shots,
        {"role": "assistant", "content": "Sure!"},
        {"role": "user", "content": "Add 1 and 2."},
    ]
    async with openai_client(app, app.registry._active["r1"]) as oai:
        reply = await oai.chat.completions.create(model="m", messages=rewritten, tools=[ADD])  # type: ignore[arg-type,list-item]
    (call,) = reply.choices[0].message.tool_calls or []
    sent_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 3}'},
    }
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [sent_call]}
    await chat(
        app, [*rewritten, tool_turn, {"role": "tool", "tool_call_id": call.id, "content": "3"}], tools=[ADD]
    )

    one, two, three = await recorded_calls(app)
    assert one.unmatched_assistant_turns == 1
    assert one.assistant_turns == (
        {"message": 2, "kind": "unmatched", "reason": "never sampled", "spliced": 0, "sampled": 0},
    )
    assert [t["reason"] for t in two.assistant_turns] == [
        "never sampled",
        "text differs at char 4 (5 chars sent, 5 returned)",
    ]
    assert three.unmatched_assistant_turns == 3
    assert three.assistant_turns[-1]["reason"] == "tool call 0 differs (arguments)"
    assert all(isinstance(c, LLMCallCompleted) for c in (one, two, three))


@pytest.mark.parametrize("appended", ["", "</code>"], ids=["as-returned", "stop-reappended"])
async def test_a_turn_after_a_changed_message_is_said_to_be_sampled_after_another_prompt(
    app: Appliance, engine: ScriptedEngine, tokenizer: Tokenizer, appended: str
) -> None:
    """A CodeAgent turn sent back after an earlier message changed is reported alike whether the
    harness re-appended its stop string or not: sampled, but after a different prompt."""
    code = "Thought: add them\n<code>\nprint(1 + 1)\n"
    engine.script(
        [*tokenizer.encode(code + "</code>\nObservation:"), tokenizer.im_end_id],
        [*tokenizer.encode("Done"), tokenizer.im_end_id],
    )
    history = [{"role": "system", "content": "Write code."}, {"role": "user", "content": "1 + 1?"}]
    returned = await chat(app, history, stop=CODE_STOPS)
    changed = [
        {"role": "system", "content": "Write Python code."},
        history[1],
        {"role": "assistant", "content": returned + appended},
        {"role": "user", "content": "2"},
    ]
    await chat(app, changed, stop=CODE_STOPS)
    _, two = await recorded_calls(app)
    reason = "sampled after a different prompt (an earlier message changed)"
    assert two.assistant_turns == (
        {"message": 2, "kind": "unmatched", "reason": reason, "spliced": 0, "sampled": 0},
    )
