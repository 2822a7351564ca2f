"""The internal conversation model every API surface converts to.

Owns ``Message`` and ``ToolCall`` and their conversion from the OpenAI Chat Completions shape.
A message's ``key`` is what makes two renderings of the same turn recognisably the same: it is
built from what the proxy itself returned to the harness (content, tool names and arguments),
never from ids a client may rewrite.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.errors import BadRequest

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


def messages_from_openai(raw: Any) -> list[Message]:
    """Validate and convert an OpenAI ``messages`` array (``developer`` is read as ``system``,
    the deprecated ``function`` as ``tool``)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    out: list[Message] = []
    for i, item in enumerate(raw):
        # The common turn (a text message of one of the plain roles, nothing else to read),
        # converted without building the names its errors would use.
        if type(item) is dict:
            role, content = item.get("role"), item.get("content")
            if type(role) is str and role in ROLES and type(content) is str and "tool_calls" not in item:
                out.append(Message(role, content, (), str(item.get("tool_call_id") or "")))
                continue
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
            out.append(Message(role="tool", content=content, tool_call_id=name))
            continue
        if role not in ROLES:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(ROLES)} or function; got {role!r}", param=where
            )
        out.append(
            Message(
                role=role,
                content=_text_content(item.get("content"), f"{where}.content"),
                tool_calls=_tool_calls(item.get("tool_calls"), f"{where}.tool_calls")
                if role == "assistant"
                else (),
                tool_call_id=str(item.get("tool_call_id") or ""),
            )
        )
    return out


def tools_from_openai(raw: Any) -> list[dict[str, Any]]:
    """Validate an OpenAI ``tools`` array; the function schemas are rendered as given."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array", param="tools")
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
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
