"""Matching turns a harness sent back changed, at the renderer: what is spliced and what is said."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.chat.messages import Message, ToolCall
from appliance.chat.render import Conversation
from appliance.chat.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def test_a_turn_echoed_as_returned_leaves_out_the_call_the_length_limit_cut(tokenizer: Tokenizer) -> None:
    conversation = Conversation(tokenizer)
    history = [Message("user", "add 1 and 2")]
    first = conversation.render(history)
    kept = tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    sampled = [*kept, *tokenizer.encode('\n<tool_call>\n{"name": "add", "argu')]
    returned = Message("assistant", "", (ToolCall("call_1", "add", '{"a": 1}'),))
    conversation.remember(first.digest, returned, sampled, None, len(tokenizer.decode(sampled)))

    second = conversation.render([*history, returned, Message("tool", "3", tool_call_id="call_1")])
    (turn,) = second.turns
    assert (turn.kind, turn.spliced, turn.sampled) == ("cut", len(kept), len(sampled))
    assert second.unmatched_assistant_turns == 0
    n = len(first.prompt_ids)
    assert second.prompt_ids[n : n + len(kept) + 1] == (*kept, tokenizer.im_end_id)


def test_a_turn_sampled_after_another_prompt_says_so(tokenizer: Tokenizer) -> None:
    conversation = Conversation(tokenizer)
    first = conversation.render([Message("user", "a")])
    reply = Message("assistant", "x")
    conversation.remember(first.digest, reply, [*tokenizer.encode("x"), tokenizer.im_end_id])
    other = conversation.render([Message("user", "b"), reply, Message("user", "c")])
    (turn,) = other.turns
    assert (turn.kind, turn.reason) == (
        "unmatched",
        "sampled after a different prompt (an earlier message changed)",
    )
    assert other.turns == conversation.render([Message("user", "b"), reply, Message("user", "d")]).turns
