"""Parsing sampled text back into an assistant message (hermes-style ``<tool_call>`` blocks).

Owns the inverse of the renderer for assistant turns: the model writes
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks; each block whose JSON
parses and names a declared tool becomes a ``ToolCall``. Anything else stays text, so nothing
the model sampled is lost or invented.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import replace

from appliance.chat.formats import split_reasoning
from appliance.chat.messages import Message, ToolCall
from appliance.chat.template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_assistant(text: str, tool_names: Collection[str], *, reasoning: bool = False) -> Message:
    """Split sampled text into reasoning (for reasoning formats), content and tool calls.

    Only blocks naming a declared tool with an object of arguments count; if any block fails to
    parse, the whole text is returned as content (the turn is then plain text to the harness).
    """
    if reasoning:
        thought, answer = split_reasoning(text)
        if thought or answer != text:
            return replace(parse_assistant(answer, tool_names), reasoning=thought)
    if not tool_names or TOOL_CALL_OPEN not in text:
        return Message(role="assistant", content=text)
    calls: list[ToolCall] = []
    for match in _BLOCK.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            return Message(role="assistant", content=text)
        if (
            not isinstance(payload, dict)
            or payload.get("name") not in tool_names
            or not isinstance(payload.get("arguments", {}), dict)
        ):
            return Message(role="assistant", content=text)
        arguments = json.dumps(payload.get("arguments", {}), ensure_ascii=False)
        calls.append(ToolCall(id=new_tool_call_id(), name=payload["name"], arguments=arguments))
    if not calls:
        return Message(role="assistant", content=text)
    # Only the end is trimmed (the template puts a newline before the calls): text that starts
    # with whitespace keeps it whether or not calls follow, so a stream can send it at once.
    content = text[: text.index(TOOL_CALL_OPEN)].rstrip()
    return Message(role="assistant", content=content, tool_calls=tuple(calls))
