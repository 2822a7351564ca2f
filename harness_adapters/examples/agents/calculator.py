"""What the question agents say alike, whatever their framework: the calculator's prompts and
its ``add`` tool.

Owns the system prompts, the ``add`` tool (its name, description, JSON schema, the Python
function, and its reply to a model's arguments), the command line every question agent takes
(``--model M "question"``) and where the final answer goes. Each agent wraps the tool in its
framework's own form (a decorator, a ``ToolParam``, a function-tool dict) and runs its own
loop; nothing here knows a framework.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness_adapters.examples.agents.answers import ANSWER_FILE

PROMPT = "You are a careful calculator. Use the add tool if it helps, then reply with only the number."
#: For an agent that offers no tool.
ANSWER_ONLY = "You are a careful calculator. Reply with only the number."

ADD_NAME = "add"
ADD_DESCRIPTION = "Add two numbers."
ADD_PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def add_reply(arguments: Any) -> str:
    """The tool's reply to a model's arguments (a mapping): the sum of ``a`` and ``b``, or why
    the arguments are unusable."""
    try:
        return str(arguments["a"] + arguments["b"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def question_parser(description: str | None, *, model_help: str | None = None) -> argparse.ArgumentParser:
    """A parser for ``--model M "question"``; the agent adds its own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("question")
    return parser


def write_answer(text: str) -> None:
    """The final answer, to ``answer.txt`` in the working directory (where the reward reads it)."""
    Path(ANSWER_FILE).write_text(text)
