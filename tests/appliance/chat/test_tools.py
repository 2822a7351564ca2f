from __future__ import annotations

import json

from appliance.chat.tools import parse_assistant


def test_hermes_tool_call_is_parsed() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    message = parse_assistant(text, {"add"})
    assert message.content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert message.tool_calls[0].id.startswith("call_")


def test_parallel_tool_calls() -> None:
    block = '<tool_call>\n{{"name": "add", "arguments": {{"a": {0}}}}}\n</tool_call>'
    message = parse_assistant(block.format(1) + "\n" + block.format(2), {"add"})
    assert [json.loads(c.arguments)["a"] for c in message.tool_calls] == [1, 2]


def test_bad_blocks_stay_text() -> None:
    for text in (
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "undeclared", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',
    ):
        message = parse_assistant(text, {"add"})
        assert message.tool_calls == ()
        assert message.content == text


def test_no_tools_declared_means_plain_text() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    assert parse_assistant(text, set()).content == text
