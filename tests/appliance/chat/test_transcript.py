"""A rollout's transcript: chat splicing and the Completions text continuation, in one object."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.chat.messages import Message
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.transcript import Transcript
from contracts.errors import BadRequest
from store.tokens import Tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def test_a_text_prompt_that_extends_the_last_continues_its_exact_ids(tokenizer: Tokenizer) -> None:
    transcript = Transcript(tokenizer)
    first = transcript.render_text("The answer is")
    assert list(first.prompt_ids) == tokenizer.encode("The answer is")
    # Sampled ids that would tokenize differently from their text: kept as sampled.
    sampled = [*tokenizer.encode(" t"), *tokenizer.encode("he"), tokenizer.im_end_id]
    text = tokenizer.decode(sampled[:-1])
    assert tokenizer.encode(text) != sampled[:-1]
    transcript.remember(first, Message("assistant", text), sampled, text, (tokenizer.im_end_id,))
    second = transcript.render_text("The answer is" + text + ". Why?")
    assert second.prompt_ids == (*first.prompt_ids, *sampled[:-1], *tokenizer.encode(". Why?"))
    assert second.spliced_tokens == len(first.prompt_ids) + len(sampled) - 1
    assert second.tokenized_tokens == len(tokenizer.encode(". Why?"))
    # Another text starts afresh.
    assert list(transcript.render_text("Unrelated").prompt_ids) == tokenizer.encode("Unrelated")


def test_a_completion_cut_at_a_stop_string_is_not_continued(tokenizer: Tokenizer) -> None:
    transcript = Transcript(tokenizer)
    first = transcript.render_text("a")
    sampled = tokenizer.encode(" b STOP c")
    transcript.remember(first, Message("assistant", " b "), sampled, " b ", ())
    # The client saw "a b " only; the ids hold more, so they cannot stand for that text.
    assert list(transcript.render_text("a b  more").prompt_ids) == tokenizer.encode("a b  more")


def test_empty_and_token_prompts(tokenizer: Tokenizer) -> None:
    transcript = Transcript(tokenizer)
    assert list(transcript.render_text("").prompt_ids) == [tokenizer.document_start_id]
    ids = tokenizer.encode("hello there")
    rendered = transcript.render_text(tuple(ids))
    assert (rendered.prompt_ids, rendered.text) == (Tokens(ids), "hello there")
    with pytest.raises(BadRequest, match="token ids must lie in"):
        transcript.render_text((tokenizer.vocab_size,))


def test_chat_turns_are_spliced_through_the_transcript(tokenizer: Tokenizer) -> None:
    transcript = Transcript(tokenizer)
    history = [Message("user", "hi")]
    first = transcript.render_chat(history)
    sampled = [*tokenizer.encode(" hel"), *tokenizer.encode("lo"), tokenizer.im_end_id]
    reply = Message("assistant", tokenizer.decode(sampled[:-1]))
    transcript.remember(first, reply, sampled, reply.content, (tokenizer.im_end_id,))
    second = transcript.render_chat([*history, reply, Message("user", "again")])
    assert second.prompt_ids[: len(first.prompt_ids) + len(sampled)] == (*first.prompt_ids, *sampled)
    assert second.spliced_tokens == len(sampled)
