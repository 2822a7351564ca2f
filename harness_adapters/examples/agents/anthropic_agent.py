"""An agent on the official ``anthropic`` SDK: a Messages loop with one tool, then the answer.

Run as ``python -m harness_adapters.examples.agents.anthropic_agent --model M "question"``.
``Anthropic()`` reads ``ANTHROPIC_BASE_URL`` (the rollout's URL without ``/v1``: the SDK adds
it) and ``ANTHROPIC_API_KEY``, which the ``command`` adapter sets. The answer goes to
``answer.txt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from anthropic import Anthropic
from anthropic.types import MessageParam, ToolParam, ToolResultBlockParam

SYSTEM = "You are a careful calculator. Use the add tool if it helps, then reply with only the number."
ADD: ToolParam = {
    "name": "add",
    "description": "Add two numbers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}


def add(arguments: Any) -> str:
    """The tool: the sum of ``a`` and ``b``, or why the arguments are unusable."""
    try:
        return str(arguments["a"] + arguments["b"])
    except (KeyError, TypeError) as exc:
        return f"error: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="Messages needs one; the appliance caps it"
    )
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("question")
    args = parser.parse_args()
    client = Anthropic()
    messages: list[MessageParam] = [{"role": "user", "content": args.question}]
    answer = ""
    for _ in range(args.max_turns):
        reply = client.messages.create(
            model=args.model, max_tokens=args.max_tokens, system=SYSTEM, messages=messages, tools=[ADD]
        )
        answer = "".join(block.text for block in reply.content if block.type == "text")
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "assistant", "content": reply.content})
        results: list[ToolResultBlockParam] = [
            {"type": "tool_result", "tool_use_id": use.id, "content": add(use.input)} for use in uses
        ]
        messages.append({"role": "user", "content": results})
    Path("answer.txt").write_text(answer)


if __name__ == "__main__":
    main()
