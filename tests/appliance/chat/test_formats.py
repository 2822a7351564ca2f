"""Chat formats: detection, default system prompts against the families' templates, reasoning."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from appliance.chat.formats import CHATML, QWEN3, QWEN25, SMOLLM2, ChatFormat, detect_format, split_reasoning
from appliance.chat.messages import Message
from appliance.chat.render import render_text
from appliance.chat.template import CHATML_HERMES_TEMPLATE
from appliance.chat.tools import parse_assistant

# SmolLM2-Instruct's template as its tokenizer_config.json ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (SMOLLM2_TEMPLATE, SMOLLM2),
        ("{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}", QWEN25),
        ("{%- if '<think>' in content %}", QWEN3),
        (CHATML_HERMES_TEMPLATE, CHATML),
    ],
)
def test_detect_format(tmp_path: Path, template: str, expected: ChatFormat) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert detect_format(tmp_path) == expected


def test_missing_config_is_plain_chatml(tmp_path: Path) -> None:
    assert detect_format(tmp_path) == CHATML


@pytest.mark.parametrize(
    "messages",
    [
        [Message("user", "hi")],
        [Message("system", "Be brief."), Message("user", "hi")],
        [Message("user", "hi"), Message("assistant", "hello"), Message("user", "2 + 2?")],
    ],
)
def test_smollm2_renders_like_its_template(messages: list[Message]) -> None:
    template = jinja2.Environment().from_string(SMOLLM2_TEMPLATE)
    raw = [{"role": m.role, "content": m.content} for m in messages]
    assert render_text(messages, (), SMOLLM2) == template.render(messages=raw, add_generation_prompt=True)


def test_qwen25_default_system_also_heads_the_tools_block() -> None:
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = render_text([Message("user", "hi")], tools, QWEN25)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert "# Tools" in text


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        ("<think>\n3 plus 4 is 7\n</think>\n\n7", "3 plus 4 is 7", "7"),
        ("7", "", "7"),
        ("<think>still going", "still going", ""),
    ],
)
def test_split_reasoning(text: str, reasoning: str, answer: str) -> None:
    assert split_reasoning(text) == (reasoning, answer)


def test_reasoning_and_tool_call_parse_together() -> None:
    text = '<think>use the tool</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    message = parse_assistant(text, {"add"}, reasoning=True)
    assert message.reasoning == "use the tool"
    assert [c.name for c in message.tool_calls] == ["add"]
    assert message.content == ""


def test_template_saved_beside_the_config_is_read(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE)
    assert detect_format(tmp_path) == SMOLLM2
