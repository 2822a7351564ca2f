"""The internal conversation model every API surface converts to.

Owns ``Message`` and ``ToolCall`` and their conversion from the OpenAI Chat Completions shape.
A message's ``key`` is what makes two renderings of the same turn recognisably the same: it is
built from what the proxy itself returned to the harness (content, tool names and arguments),
never from ids a client may rewrite. A conversation's ``MessageMemo`` lets its next request's
conversion take the messages it repeats from the last one, so reading a request costs what it
adds, not the whole history.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from contracts.errors import BadRequest

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    #: The arguments as a JSON text, exactly as returned to the harness.
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    #: Reasoning the model wrote before its answer (``<think>``); not part of the turn's key,
    #: since clients rarely send it back.
    reasoning: str = ""

    @property
    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        """Identity of a turn for splicing: role, text and tool calls, without client-side ids."""
        return (self.role, self.content, tuple((c.name, c.arguments) for c in self.tool_calls))


def _text_content(value: Any, where: str) -> str:
    """OpenAI content is a string or a list of parts; only text parts are supported."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts: list[str] = []
        for part in value:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise BadRequest(f"{where}: only text content parts are supported", param=where)
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{where}: a text part needs a string 'text'", param=where)
            texts.append(text)
        return "".join(texts)
    raise BadRequest(f"{where}: content must be a string or a list of parts", param=where)


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadRequest(f"{where}: tool_calls must be a list", param=where)
    calls: list[ToolCall] = []
    for i, raw in enumerate(value):
        fn = raw.get("function") if isinstance(raw, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}[{i}]: a tool call needs function.name", param=where)
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(id=str(raw.get("id", "")), name=fn["name"], arguments=arguments))
    return tuple(calls)


@dataclass(slots=True)
class MessageMemo:
    """The last ``messages`` array one conversation sent, and what it was converted to.

    A conversation's next request repeats that array and adds to it; where the repeated part
    compares equal, its messages are taken from here (the same objects, which the renderer
    recognises without looking at their text), so only the added messages are read and
    validated. Equality of JSON values implies the same conversion only where nothing in a
    message is a number or a boolean (``1 == 1.0 == True``); the positions of messages that hold
    one are converted again on every request."""

    raw: list[Any] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    #: Positions converted again each time (a number or a boolean somewhere in the message).
    inexact: list[int] = field(default_factory=list)


#: The memo of the conversation whose request is being read (see ``reading_conversation``).
_MEMO: ContextVar[MessageMemo | None] = ContextVar("message_memo", default=None)


@contextmanager
def reading_conversation(memo: MessageMemo) -> Iterator[None]:
    """Within the block, ``messages_from_openai`` reuses and updates ``memo`` (the conversation
    the request being parsed belongs to)."""
    token = _MEMO.set(memo)
    try:
        yield
    finally:
        _MEMO.reset(token)


def messages_from_openai(raw: Any, memo: MessageMemo | None = None) -> list[Message]:
    """Validate and convert an OpenAI ``messages`` array (``developer`` is read as ``system``,
    the deprecated ``function`` as ``tool``).

    With a memo (given, or set by ``reading_conversation``), the messages the conversation sent
    last time are taken from it when they come again unchanged (their converted messages, and in
    ``raw`` their JSON objects), and the memo then holds this array."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if memo is None:
        memo = _MEMO.get()
    start = 0
    out: list[Message] = []
    inexact: list[int] = []
    if memo is not None and memo.raw:
        seen = len(memo.raw)
        if len(raw) >= seen and raw[:seen] == memo.raw:
            start = seen
            out = memo.messages[:]
            for i in memo.inexact:
                out[i] = _message(raw[i], i)
            inexact = memo.inexact[:]
    for i in range(start, len(raw)):
        item = raw[i]
        out.append(_message(item, i))
        if memo is not None and not _exact(item):
            inexact.append(i)
    if memo is not None:
        if start:
            # ``raw`` (the request, as its call records it) keeps the memo's objects for what it
            # repeats: equal values, so the same request (an object's key order aside), and a
            # recorded call holds only what it added, not another copy of the conversation; the
            # store's comparison with the last call's request then meets the same objects. A
            # message with a number or a boolean stays the request's own.
            repeated = memo.raw[:]
            for i in memo.inexact:
                repeated[i] = raw[i]
            raw[:start] = repeated
        memo.raw, memo.messages, memo.inexact = raw[:], out[:], inexact
    return out


def _message(item: Any, i: int) -> Message:
    """One validated message of a ``messages`` array (``i``: its position, for errors)."""
    # The common turn (a text message of one of the plain roles, nothing else to read),
    # converted without building the names its errors would use.
    if type(item) is dict:
        role, content = item.get("role"), item.get("content")
        if type(role) is str and role in ROLES and type(content) is str and "tool_calls" not in item:
            return Message(role, content, (), str(item.get("tool_call_id") or ""))
    where = f"messages[{i}]"
    if not isinstance(item, Mapping):
        raise BadRequest(f"{where} must be an object", param=where)
    role = item.get("role")
    if role == "developer":
        role = "system"
    if role == "function":
        # The deprecated function result: a tool result under another name (its ``name``
        # stands where ``tool_call_id`` would), rendered as one.
        name = item.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"{where}: a function message needs a string 'name'", param=where)
        content = _text_content(item.get("content"), f"{where}.content")
        return Message(role="tool", content=content, tool_call_id=name)
    if role not in ROLES:
        raise BadRequest(
            f"{where}.role must be one of {', '.join(ROLES)} or function; got {role!r}", param=where
        )
    return Message(
        role=role,
        content=_text_content(item.get("content"), f"{where}.content"),
        tool_calls=_tool_calls(item.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else (),
        tool_call_id=str(item.get("tool_call_id") or ""),
    )


def _exact(value: Any) -> bool:
    """Whether everything equal to ``value`` is the same JSON: strings, nulls, and arrays and
    objects of them (not numbers or booleans, which compare equal across types)."""
    if type(value) is str or value is None:
        return True
    if type(value) is dict:
        return all(_exact(v) for v in value.values())
    if type(value) is list:
        return all(_exact(v) for v in value)
    return False


def tool_array(raw: Any) -> list[Any]:
    """A request's ``tools``: its array, [] when absent (``BadRequest`` if it is not an array)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array", param="tools")
    return raw


def tools_from_openai(raw: Any) -> list[dict[str, Any]]:
    """Validate an OpenAI ``tools`` array; the function schemas are rendered as given."""
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(tool_array(raw)):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] needs a function with a name", param=f"tools[{i}]")
        tools.append(dict(tool))
    return tools


def assistant_to_openai(message: Message) -> dict[str, Any]:
    """The assistant message as an OpenAI ``choices[i].message`` object."""
    out: dict[str, Any] = {
        "role": "assistant",
        "content": message.content if message.content or not message.tool_calls else None,
        "refusal": None,
    }
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    return out


def tool_schema_names(tools: Sequence[Mapping[str, Any]]) -> set[str]:
    return {str(t["function"]["name"]) for t in tools}
