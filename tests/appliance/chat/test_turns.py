"""Matching turns a harness sent back changed, at the renderer: what is spliced and what is said."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.chat.messages import Message, ToolCall
from appliance.chat.render import SAMPLED_TURNS_PER_PROMPT, Conversation
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.turns import TurnMatch


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


def test_a_prompt_sampled_many_times_keeps_its_newest_turns_for_a_changed_match(tokenizer: Tokenizer) -> None:
    # A harness asking one prompt again and again: a turn sent back changed is compared with the
    # newest SAMPLED_TURNS_PER_PROMPT answers; every answer still splices when sent back as is.
    conversation = Conversation(tokenizer)
    history = [Message("user", "count")]
    first = conversation.render(history)
    times = SAMPLED_TURNS_PER_PROMPT + 20
    for i in range(times):
        reply = Message("assistant", f"answer {i}")
        conversation.remember(first.digest, reply, [*tokenizer.encode(reply.content), tokenizer.im_end_id])

    def turn_of(content: str) -> TurnMatch | None:
        rendered = conversation.render([*history, Message("assistant", content), Message("user", "again")])
        return rendered.turns[0] if rendered.turns else None

    assert turn_of("answer 0") is None and turn_of(f"answer {times - 1}") is None  # spliced as sampled
    newest = turn_of(f"answer {times - 1} and more")
    assert newest is not None and newest.kind == "extended"
    kept = turn_of(f"answer {times - SAMPLED_TURNS_PER_PROMPT} and more")
    assert kept is not None and kept.kind == "extended"
    dropped = turn_of(f"answer {times - SAMPLED_TURNS_PER_PROMPT - 1} and more")
    assert dropped is not None and dropped.kind == "unmatched"


def test_a_bounded_conversation_forgets_its_oldest_sampled_turns(tokenizer: Tokenizer) -> None:
    # The rollout-less conversation lives as long as the process: it splices its newest
    # ``max_sampled`` turns exactly; older ones come back as turns that match nothing sampled.
    conversation = Conversation(tokenizer, max_sampled=3)
    asked = [Message("user", f"question {i}") for i in range(5)]
    answers = [Message("assistant", f"answer {i}") for i in range(5)]

    def sample(i: int) -> None:
        rendered = conversation.render([asked[i]])
        ids = [*tokenizer.encode(answers[i].content), tokenizer.im_end_id]
        conversation.remember(rendered.digest, answers[i], ids)

    # The first sampled again after the third: remembered anew, as the newest, so the fourth and
    # fifth make the second and third the ones forgotten.
    for i in (0, 1, 2, 0, 3, 4):
        sample(i)

    def spliced(i: int) -> bool:
        rendered = conversation.render([asked[i], answers[i], Message("user", "and then?")])
        assert rendered.unmatched_assistant_turns == (0 if not rendered.turns else 1)
        return not rendered.turns and rendered.spliced_tokens > 0

    assert [spliced(i) for i in range(5)] == [True, False, False, True, True]
    unbounded = Conversation(tokenizer)
    for question, answer in zip(asked, answers, strict=True):
        rendered = unbounded.render([question])
        unbounded.remember(rendered.digest, answer, [*tokenizer.encode(answer.content), tokenizer.im_end_id])
    assert all(not unbounded.render([asked[i], answers[i], Message("user", "?")]).turns for i in range(5))


@pytest.mark.parametrize(
    "sent",
    ["print(1)\n", "print(1)\n</code>", "print(1)\n</code>\nCalling tools: ...", "print(1)"],
    ids=["as-returned", "stop-appended", "stop-and-more-appended", "prefix"],
)
def test_a_changed_turn_after_a_changed_prompt_is_diagnosed_as_the_turn_itself_would_be(
    tokenizer: Tokenizer, sent: str
) -> None:
    # A turn the harness sent back changed in a way that would splice (its stop string or more
    # text appended), after an earlier message changed: it was sampled, only after another prompt.
    conversation = Conversation(tokenizer)
    first = conversation.render([Message("user", "write code")])
    returned = Message("assistant", "print(1)\n")
    sampled = tokenizer.encode("print(1)\n</code>")
    conversation.remember(first.digest, returned, sampled, "</code>", len(returned.content))

    same = conversation.render(
        [Message("user", "write code"), Message("assistant", sent), Message("user", "ok")]
    )
    assert same.unmatched_assistant_turns == 0 and same.spliced_tokens > 0  # the same prompt: spliced
    changed = [Message("user", "write more code"), Message("assistant", sent), Message("user", "ok")]
    (turn,) = conversation.render(changed).turns
    assert (turn.kind, turn.reason) == (
        "unmatched",
        "sampled after a different prompt (an earlier message changed)",
    )
    (never,) = Conversation(tokenizer).render(changed).turns
    assert (never.kind, never.reason) == ("unmatched", "never sampled")
