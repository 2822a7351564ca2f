"""A live rollout's transcript: everything that lets a later call continue an earlier one exactly.

Owns the continuation state of one rollout, whatever surface its calls come through: the chat
conversation (sampled turns spliced token for token into later prompts, see
``appliance.chat.render``) and the text transcript of the Completions surface (the last prompt +
completion as text and as its exact ids, so a text prompt that continues it reuses those ids and
tokenizes only the new text), and the memo of the last ``messages`` array the rollout sent
(``appliance.chat.messages.MessageMemo``: a request is read for this rollout within
``reading_conversation(transcript.messages)``, so the messages it repeats are not read again),
and before that the head of its last request body (``BodyHead``: a body that repeats it byte for
byte is read from where it ends, ``appliance.proxy.bodies.read_conversation``).
A surface hands over messages or a text/token-id prompt and gets a ``RenderedPrompt``; after
the call, ``remember`` records what was sampled. Nothing here is durable: it is the
cheap-to-lose render state of a running rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.chat.formats import CHATML, ChatFormat
from appliance.chat.messages import Message, MessageMemo
from appliance.chat.render import Conversation, RenderedPrompt
from appliance.chat.tokenizer import Tokenizer
from contracts.errors import BadRequest
from store.tokens import Tokens


@dataclass(slots=True)
class BodyHead:
    """One conversation's last request body up to the end of its ``messages`` (or ``input``)
    array's last element (``raw``; empty: nothing to continue from), and what those bytes hold:
    the members before the array and the array's elements, as read."""

    raw: bytes = b""
    before: dict[str, Any] = field(default_factory=dict)
    messages: list[Any] = field(default_factory=list)
    #: The array's member: ``messages`` (Chat Completions, Messages) or ``input`` (Responses).
    key: str = "messages"

    def forget(self) -> None:
        self.raw, self.before, self.messages = b"", {}, []


@dataclass(slots=True)
class Transcript:
    tokenizer: Tokenizer
    fmt: ChatFormat = CHATML
    #: The chat turns sampled that are remembered for splicing (``Conversation.max_sampled``).
    max_sampled: int | None = None
    conversation: Conversation = field(init=False)
    #: The last Chat Completions ``messages`` array and its conversion.
    messages: MessageMemo = field(default_factory=MessageMemo)
    #: The last body's bytes up to its ``messages`` (``input``) array's end (``appliance.proxy.bodies``).
    body: BodyHead = field(default_factory=BodyHead)
    #: Completions: the last prompt + completion text, and its exact ids.
    _text: str = ""
    _text_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.conversation = Conversation(self.tokenizer, self.fmt, self.max_sampled)

    def render_chat(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()
    ) -> RenderedPrompt:
        """A chat conversation as prompt ids, earlier sampled turns spliced in."""
        return self.conversation.render(messages, tools)

    def render_text(self, prompt: str | Sequence[int]) -> RenderedPrompt:
        """A Completions prompt (text, or token ids taken as they are) as prompt ids.

        A text prompt that extends the last prompt + completion reuses its ids; an empty one
        starts a new document (after the separator, as in pretraining)."""
        if not isinstance(prompt, str):
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise BadRequest(f"'prompt' token ids must lie in [0, {vocab})", param="prompt")
            return _text_prompt(list(prompt), self.tokenizer.decode(list(prompt)), tokenized=0)
        if self._text and prompt.startswith(self._text):
            new = self.tokenizer.encode(prompt[len(self._text) :])
            return _text_prompt(self._text_ids + new, prompt, tokenized=len(new), spliced=len(self._text_ids))
        ids = self.tokenizer.encode(prompt) or [self.tokenizer.document_start_id]
        return _text_prompt(ids, prompt, tokenized=len(ids))

    def remember(
        self,
        prompt: RenderedPrompt,
        message: Message,
        response_ids: Sequence[int],
        text: str,
        stop_ids: Sequence[int] = (),
        stop_sequence: str | None = None,
    ) -> None:
        """Record a finished call: ``response_ids`` (ending with one of ``stop_ids`` if one was
        sampled) were sampled after ``prompt`` and read as ``message`` (chat) or ``text`` (cut
        before the stop string ``stop_sequence``, if one matched)."""
        if prompt.digest:
            self.conversation.remember(prompt.digest, message, response_ids, stop_sequence, len(text))
        if prompt.text is None:
            return
        body = list(response_ids)
        if body and body[-1] in stop_ids:
            body = body[:-1]
        if self.tokenizer.decode(body) != text:
            # Cut at a stop string: the text the client got no longer matches the ids, so the
            # next prompt is tokenized afresh rather than continued from ids it does not show.
            self._text, self._text_ids = "", []
            return
        self._text = prompt.text + text
        self._text_ids = [*prompt.prompt_ids, *body]


def _text_prompt(ids: list[int], text: str, *, tokenized: int, spliced: int = 0) -> RenderedPrompt:
    return RenderedPrompt(
        prompt_ids=Tokens(ids),
        digest=b"",
        spliced_tokens=spliced,
        tokenized_tokens=tokenized,
        unmatched_assistant_turns=0,
        text=text,
    )
