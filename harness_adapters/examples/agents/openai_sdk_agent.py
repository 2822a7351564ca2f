"""An agent on the official ``openai`` SDK: a chat loop with one tool, then the final answer.

Run as ``python -m harness_adapters.examples.agents.openai_sdk_agent --model M "question"``.
``OpenAI()`` reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, which the ``command`` adapter
sets to the rollout's endpoint. The answer goes to ``answer.txt``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from openai import OpenAI
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

SYSTEM = "You are a careful calculator. Use the add tool if it helps, then reply with only the number."
ADD: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


def add(arguments: str) -> str:
    """The tool: the sum of ``a`` and ``b``, or why the arguments are unusable."""
    try:
        values = json.loads(arguments)
        return str(values["a"] + values["b"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("question")
    args = parser.parse_args()
    client = OpenAI()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": args.question},
    ]
    answer = ""
    for _ in range(args.max_turns):
        reply = client.chat.completions.create(model=args.model, messages=messages, tools=[ADD])
        message = reply.choices[0].message
        answer = message.content or ""
        calls = [call for call in message.tool_calls or [] if call.type == "function"]
        if not calls:
            break
        messages.append(message.model_dump(exclude_none=True))  # type: ignore[arg-type]
        for call in calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": add(call.function.arguments)}
            )
    Path("answer.txt").write_text(answer)


if __name__ == "__main__":
    main()
