"""An agent on the official ``openai`` SDK: a chat loop with one tool, then the final answer.

Run as ``python -m harness_adapters.examples.agents.openai_sdk_agent --model M "question"``.
``OpenAI()`` reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, which the ``command`` adapter
sets to the rollout's endpoint. The answer goes to ``answer.txt``.
"""

from __future__ import annotations

import json

from openai import OpenAI
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from harness_adapters.examples.agents import calculator

ADD: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": calculator.ADD_NAME,
        "description": calculator.ADD_DESCRIPTION,
        "parameters": calculator.ADD_PARAMETERS,
    },
}


def add(arguments: str) -> str:
    """The tool on the model's JSON arguments: the sum, or why the arguments are unusable."""
    try:
        values = json.loads(arguments)
    except ValueError as exc:
        return f"error: {exc}"
    return calculator.add_reply(values)


def main() -> None:
    parser = calculator.question_parser(__doc__)
    parser.add_argument("--max-turns", type=int, default=3)
    args = parser.parse_args()
    client = OpenAI()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": calculator.PROMPT},
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
    calculator.write_answer(answer)


if __name__ == "__main__":
    main()
