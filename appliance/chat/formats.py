"""Chat formats of the model families the proxy renders for.

Owns what differs between ChatML-family models that share the hermes ``<tool_call>`` format:
the system prompt a template inserts when the conversation has none, and whether the model
writes ``<think>...</think>`` reasoning that must be parsed out of the sampled text. The format
of a model directory is detected from its chat template.

| format          | default system prompt                                      | reasoning |
|-----------------|------------------------------------------------------------|-----------|
| ``chatml``      | none (the tiny test model, generic ChatML + hermes tools)  | no        |
| ``qwen2.5``     | "You are Qwen, created by Alibaba Cloud. ..."              | no        |
| ``qwen3``       | none                                                       | yes       |
| ``smollm2``     | "You are a helpful AI assistant named SmolLM, ..."         | no        |

SmolLM2's own template knows no tools; tools are rendered for it in the hermes format above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ChatFormat:
    name: str
    #: Inserted as the first message when a conversation has no system message.
    default_system: str | None = None
    #: The model writes ``<think>...</think>`` before its answer.
    reasoning: bool = False


CHATML = ChatFormat("chatml")
QWEN25 = ChatFormat(
    "qwen2.5", default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
)
QWEN3 = ChatFormat("qwen3", reasoning=True)
SMOLLM2 = ChatFormat(
    "smollm2", default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face"
)

FORMATS = {f.name: f for f in (CHATML, QWEN25, QWEN3, SMOLLM2)}


def detect_format(model_dir: Path) -> ChatFormat:
    """The format whose template the model directory's ``tokenizer_config.json`` carries."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    template = config.get("chat_template") or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    jinja = model_dir / "chat_template.jinja"  # where transformers 5 saves the template
    if not template and jinja.is_file():
        template = jinja.read_text()
    if "SmolLM" in template:
        return SMOLLM2
    if "You are Qwen" in template:
        return QWEN25
    if "<think>" in template:
        return QWEN3
    return CHATML


def split_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a reply that may open with a ``<think>`` block."""
    stripped = text.lstrip()
    if not stripped.startswith("<think>"):
        return "", text
    end = stripped.find("</think>")
    if end < 0:
        return stripped[len("<think>") :].strip(), ""  # still thinking when it was cut off
    return stripped[len("<think>") : end].strip(), stripped[end + len("</think>") :].lstrip()
