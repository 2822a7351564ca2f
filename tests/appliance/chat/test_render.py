"""The renderer against the model's own chat template, and the splicing of sampled turns."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from transformers import AutoTokenizer

from appliance.chat.formats import CHATML, QWEN25, ChatFormat
from appliance.chat.messages import Message, MessageMemo, ToolCall, messages_from_openai
from appliance.chat.render import GENERATION_PROMPT, Conversation, render_text
from appliance.chat.tokenizer import Tokenizer

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}

CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = [
    ([{"role": "user", "content": "hi"}], []),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}], []),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "add 1 and 2"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                    },
                    {
                        "id": "b",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "3"},
            {"role": "tool", "tool_call_id": "b", "content": "7"},
            {"role": "assistant", "content": "3 and 7"},
            {"role": "user", "content": "thanks"},
        ],
        [ADD],
    ),
    ([{"role": "user", "content": "no system, with tools"}], [ADD]),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest.mark.parametrize(("raw", "tools"), CONVERSATIONS)
def test_render_text_equals_the_jinja_template(
    tiny_model_dir: Path, raw: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    template_tools: Any = tools or None
    expected = hf.apply_chat_template(raw, tools=template_tools, add_generation_prompt=True, tokenize=False)
    assert render_text(messages_from_openai(raw), tools) == expected


@pytest.mark.parametrize(("raw", "tools"), CONVERSATIONS)
def test_segment_tokenization_equals_whole_text_tokenization(
    tokenizer: Tokenizer, raw: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> None:
    messages = messages_from_openai(raw)
    rendered = Conversation(tokenizer).render(messages, tools)
    assert list(rendered.prompt_ids) == tokenizer.encode(render_text(messages, tools))
    assert rendered.spliced_tokens == 0


def test_sampled_turn_is_spliced_token_for_token(tokenizer: Tokenizer) -> None:
    conversation = Conversation(tokenizer)
    history = [Message("system", "S"), Message("user", "What is 2 + 3?")]
    first = conversation.render(history)
    # Token ids a model might sample: text whose re-tokenization differs (split digits).
    five = tokenizer.encode("5")
    sampled = [*five, *tokenizer.encode(" "), tokenizer.im_end_id]
    reply = Message("assistant", tokenizer.decode(sampled[:-1]))
    conversation.remember(first.digest, reply, sampled)

    second = conversation.render([*history, reply, Message("user", "Sure?")])
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    after = second.prompt_ids[len(first.prompt_ids) :]
    assert list(after[: len(sampled)]) == sampled
    assert second.spliced_tokens == len(sampled)
    assert second.unmatched_assistant_turns == 0


def test_turn_is_not_spliced_under_another_prefix(tokenizer: Tokenizer) -> None:
    conversation = Conversation(tokenizer)
    first = conversation.render([Message("user", "a")])
    reply = Message("assistant", "x")
    conversation.remember(first.digest, reply, [*tokenizer.encode("x"), tokenizer.im_end_id])
    other = conversation.render([Message("user", "b"), reply, Message("user", "c")])
    assert other.spliced_tokens == 0
    assert other.unmatched_assistant_turns == 1


def test_rendering_is_incremental(tokenizer: Tokenizer) -> None:
    conversation = Conversation(tokenizer)
    history = [Message("system", "S " * 200), Message("user", "long question " * 50)]
    first = conversation.render(history)
    assert first.tokenized_tokens == len(first.prompt_ids) - len(tokenizer.encode(GENERATION_PROMPT))
    reply = Message("assistant", "ok")
    conversation.remember(first.digest, reply, [*tokenizer.encode("ok"), tokenizer.im_end_id])
    follow_up = Message("user", "next")
    second = conversation.render([*history, reply, follow_up])
    # Only the new user turn was tokenized; the long history and the sampled turn were reused.
    assert second.tokenized_tokens == len(tokenizer.encode("<|im_start|>user\nnext<|im_end|>\n"))


def test_tool_call_turn_splices_when_echoed_back(tokenizer: Tokenizer) -> None:
    conversation = Conversation(tokenizer)
    history = [Message("user", "add 1 2")]
    first = conversation.render(history, [ADD])
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    sampled = [*tokenizer.encode(text), tokenizer.im_end_id]
    reply = Message("assistant", "", (ToolCall("call_1", "add", '{"a": 1, "b": 2}'),))
    conversation.remember(first.digest, reply, sampled)
    echoed = Message("assistant", "", (ToolCall("client-rewrote-id", "add", '{"a": 1, "b": 2}'),))
    second = conversation.render([*history, echoed, Message("tool", "3", tool_call_id="x")], [ADD])
    assert second.prompt_ids[: len(first.prompt_ids) + len(sampled)] == (*first.prompt_ids, *sampled)


def test_incremental_ids_equal_a_fresh_render_after_every_kind_of_edit(tokenizer: Tokenizer) -> None:
    """The ids kept from the last request are cut where a new request departs from it: whatever
    the client sends next (a longer history, a rewritten turn, a shorter one, other tools), the
    prompt is exactly what rendering it from nothing gives."""
    base = messages_from_openai(CONVERSATIONS[2][0])
    requests: list[tuple[list[Message], list[dict[str, Any]]]] = [
        (base, [ADD]),
        ([*base, Message("assistant", "ok"), Message("user", "more")], [ADD]),
        ([*base[:3], Message("tool", "30", tool_call_id="a"), *base[4:]], [ADD]),  # a rewritten turn
        (base[:2], [ADD]),  # a shorter history
        (base, []),  # no tools: another first segment
        ([*base, Message("user", "again")], []),
    ]
    conversation = Conversation(tokenizer)
    for messages, tools in requests:
        rendered = conversation.render(messages, tools)
        assert rendered.prompt_ids == Conversation(tokenizer).render(messages, tools).prompt_ids
        assert list(rendered.prompt_ids) == tokenizer.encode(render_text(messages, tools))
        assert rendered.prompt_json == orjson.dumps(rendered.prompt_ids.tolist())


def test_a_render_that_fails_leaves_the_next_one_exact(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversation = Conversation(tokenizer)
    history = [Message("system", "S"), Message("user", "first")]
    first = conversation.render(history)
    reply = Message("assistant", "ok")
    sampled = [*tokenizer.encode("ok"), tokenizer.im_end_id]
    conversation.remember(first.digest, reply, sampled)
    longer = [*history, reply, Message("user", "second"), Message("assistant", "x"), Message("user", "y")]

    calls = 0
    encode = tokenizer.encode

    def failing(text: str) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second new segment: the kept ids are half extended by now
            raise RuntimeError("tokenizer failed")
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", failing)
    with pytest.raises(RuntimeError):
        conversation.render(longer)
    monkeypatch.setattr(tokenizer, "encode", encode)
    again = conversation.render(longer)
    fresh = Conversation(tokenizer)
    fresh.remember(first.digest, reply, sampled)
    assert again.prompt_ids == fresh.render(longer).prompt_ids
    assert again.prompt_json == orjson.dumps(again.prompt_ids.tolist())
    assert again.spliced_tokens == len(sampled)


@pytest.mark.parametrize("fmt", [CHATML, QWEN25], ids=lambda f: f.name)
def test_incremental_ids_equal_a_fresh_render_for_any_sequence_of_requests(
    tokenizer: Tokenizer, fmt: ChatFormat
) -> None:
    """Random requests to one conversation (histories that grow, runs of tool results that a
    later request continues, rewritten and dropped turns, a system message that comes and goes,
    tools added and removed), read through the conversation's memo as the proxy reads them: each
    prompt is the one rendered from nothing."""
    rng = random.Random(3)
    pool: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "add 1 and 2"},
        CONVERSATIONS[2][0][2],
        {"role": "tool", "tool_call_id": "a", "content": "3"},
        {"role": "tool", "tool_call_id": "b", "content": "7"},
        {"role": "assistant", "content": "3 and 7"},
        {"role": "user", "content": "thanks"},
    ]
    memo = MessageMemo()
    conversation = Conversation(tokenizer, fmt)
    raw: list[dict[str, Any]] = [pool[1]]
    tools: list[dict[str, Any]] = []
    for _ in range(150):
        step = rng.randrange(8)
        if step <= 3:
            raw = raw + [rng.choice(pool[1:]) for _ in range(rng.randrange(1, 3))]
        elif step == 4 and len(raw) > 1:
            raw = raw[: rng.randrange(1, len(raw))]
        elif step == 5:
            at = rng.randrange(len(raw))
            raw = [*raw[:at], rng.choice(pool[1:]), *raw[at + 1 :]]
        elif step == 6:
            raw = raw[1:] if raw[0]["role"] == "system" and len(raw) > 1 else [pool[0], *raw]
        else:
            tools = [] if tools else [ADD]
        messages = messages_from_openai([dict(m) for m in raw], memo)
        rendered = conversation.render(messages, tools)
        assert rendered.prompt_ids == Conversation(tokenizer, fmt).render(messages, tools).prompt_ids
        assert list(rendered.prompt_ids) == tokenizer.encode(render_text(messages, tools, fmt))
        assert rendered.prompt_json == orjson.dumps(rendered.prompt_ids.tolist())


def test_a_continued_run_of_tool_results_is_one_segment(tokenizer: Tokenizer) -> None:
    conversation = Conversation(tokenizer)
    history = messages_from_openai(CONVERSATIONS[2][0][:4])  # ends with one tool result
    conversation.render(history, [ADD])
    more = [*history, Message("tool", "7", tool_call_id="b")]
    rendered = conversation.render(more, [ADD])
    assert list(rendered.prompt_ids) == tokenizer.encode(render_text(more, [ADD]))
    results = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in ("3", "7"))
    run = f"<|im_start|>user{results}<|im_end|>\n"
    assert rendered.tokenized_tokens == len(tokenizer.encode(run))
