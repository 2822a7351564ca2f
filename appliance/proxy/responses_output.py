"""The Responses surface's answers: the ``response`` object and its numbered event stream.

Owns how one finished call is shown to a Responses client: a message item (left out when the turn
is tool calls without text), then one ``function_call`` item per tool call, usage, and
``status: "incomplete"`` for a completion cut at ``max_output_tokens``; and ``ResponseEvents``,
the ``response.*`` events of a stream, numbered, whose deltas add up to the final text. It does
not read request bodies nor store anything (``openai_responses`` does both, and passes the
fields a response repeats in as ``echo``). Pure: no I/O, no tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from appliance.chat.messages import ToolCall
from appliance.proxy.pipeline import Answer, Event
from contracts.errors import ApplianceError


def _message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(answer: Answer, *, with_bytes: bool = True) -> list[dict[str, Any]]:
    """The sampled tokens' log-probs in the Responses shape (``include`` asked for them): an
    output text part's entries carry each token's UTF-8 ``bytes``, a text event's do not."""

    def entry(token: str, logprob: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {"token": token, "logprob": logprob}
        if with_bytes:
            out["bytes"] = list(token.encode())
        return out

    return [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
        for e in answer.logprobs or ()
    ]


def _call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def _shows_message(answer: Answer) -> bool:
    """The message item is left out only when the turn is tool calls without any text."""
    return bool(answer.message.content) or not answer.message.tool_calls


def output_items(answer: Answer) -> list[dict[str, Any]]:
    """A finished answer's output items: its message, then its function calls."""
    message = answer.message
    items = [_message_item("msg_" + answer.call_id, message.content, "completed", _logprobs(answer))]
    calls = [
        _call_item(f"fc_{answer.call_id}_{i}", c, c.arguments, "completed")
        for i, c in enumerate(message.tool_calls)
    ]
    return (items if _shows_message(answer) else []) + calls


def response_object(
    call_id: str, echo: Mapping[str, Any], output: list[dict[str, Any]], answer: Answer | None
) -> dict[str, Any]:
    """The ``response`` object: in progress while ``answer`` is None, else completed (or
    incomplete, when cut at ``max_output_tokens``) with its usage."""
    status, usage = "in_progress", None
    if answer is not None:
        status = "incomplete" if answer.truncated else "completed"
        generated = answer.completion_tokens
        usage = {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + generated,
        }
    return {
        "id": "resp_" + call_id,
        "object": "response",
        **echo,
        "status": status,
        "completed_at": int(time.time()) if answer is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "output": output,
        "usage": usage,
    }


class ResponseEvents:
    """One call as the Responses event sequence, numbering every event."""

    def __init__(
        self,
        call_id: str,
        echo: Mapping[str, Any],
        *,
        hold_space: bool,
        answered: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        self.call_id, self.echo = call_id, echo
        #: Response objects already made (and stored): the stream ends with the one stored.
        self.answered = {} if answered is None else answered
        self.sequence = 0
        self.message_id = "msg_" + call_id
        self.message_open = False
        self.sent = ""  # text sent as deltas
        # With tools declared, the text before a tool call loses its trailing whitespace: that
        # waits until more text follows (or the end), so the deltas add up to the final text.
        self.strip = hold_space
        self.held = ""

    def _event(self, kind: str, **fields: Any) -> Event:
        event = (kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return event

    def _open_message(self) -> list[Event]:
        if self.message_open:
            return []
        self.message_open = True
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=_message_item(self.message_id, None, "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=_text_part(""),
            ),
        ]

    def _delta(self, text: str) -> list[Event]:
        events = self._open_message()
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        self.sent += text
        return events

    def opening(self) -> list[Event]:
        started = response_object(self.call_id, self.echo, [], None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def text(self, delta: str) -> list[Event]:
        if not self.strip:
            return self._delta(delta)
        self.held += delta
        text = self.held.rstrip()
        if not text:
            return []
        self.held = self.held[len(text) :]
        return self._delta(text)

    def closing(self, answer: Answer) -> list[Event]:
        events: list[Event] = []
        output: list[dict[str, Any]] = []
        content = answer.message.content
        if self.message_open or _shows_message(answer):
            events += self._open_message()
            if content.startswith(self.sent) and len(content) > len(self.sent):
                events += self._delta(content[len(self.sent) :])
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            # Every log-prob arrives with the text's end (the deltas carry none).
            logprobs = _logprobs(answer)
            plain = _logprobs(answer, with_bytes=False)
            events.append(self._event("response.output_text.done", **where, text=content, logprobs=plain))
            part = _text_part(content, logprobs)
            events.append(self._event("response.content_part.done", **where, part=part))
            output.append(_message_item(self.message_id, content, "completed", logprobs))
            events.append(self._event("response.output_item.done", output_index=0, item=output[-1]))
        for i, call in enumerate(answer.message.tool_calls):
            index, item_id = len(output), f"fc_{answer.call_id}_{i}"
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item=_call_item(item_id, call, "", "in_progress"),
                )
            )
            where = {"item_id": item_id, "output_index": index}
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
            )
            events.append(
                self._event("response.function_call_arguments.done", **where, arguments=call.arguments)
            )
            output.append(_call_item(item_id, call, call.arguments, "completed"))
            events.append(self._event("response.output_item.done", output_index=index, item=output[-1]))
        final = self.answered.get(answer.call_id) or response_object(
            answer.call_id, self.echo, output, answer
        )
        events.append(self._event(f"response.{final['status']}", response=final))
        return events

    def failed(self, error: ApplianceError) -> list[Event]:
        return [self._event("error", code=error.code, message=error.message, param=error.param)]

    def trailer(self) -> list[Event]:
        return []
