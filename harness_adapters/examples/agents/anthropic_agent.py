"""An agent on the official ``anthropic`` SDK: a Messages loop with one tool, then the answer.

Run as ``python -m harness_adapters.examples.agents.anthropic_agent --model M "question"``.
``Anthropic()`` reads ``ANTHROPIC_BASE_URL`` (the rollout's URL without ``/v1``: the SDK adds
it) and ``ANTHROPIC_API_KEY``, which the ``command`` adapter sets. The answer goes to
``answer.txt``.
"""

from __future__ import annotations

from anthropic import Anthropic
from anthropic.types import MessageParam, ToolParam, ToolResultBlockParam

from harness_adapters.examples.agents import calculator

ADD: ToolParam = {
    "name": calculator.ADD_NAME,
    "description": calculator.ADD_DESCRIPTION,
    "input_schema": calculator.ADD_PARAMETERS,
}


def main() -> None:
    parser = calculator.question_parser(__doc__)
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="Messages needs one; the appliance caps it"
    )
    parser.add_argument("--max-turns", type=int, default=3)
    args = parser.parse_args()
    client = Anthropic()
    messages: list[MessageParam] = [{"role": "user", "content": args.question}]
    answer = ""
    for _ in range(args.max_turns):
        reply = client.messages.create(
            model=args.model,
            max_tokens=args.max_tokens,
            system=calculator.PROMPT,
            messages=messages,
            tools=[ADD],
        )
        answer = "".join(block.text for block in reply.content if block.type == "text")
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "assistant", "content": reply.content})
        results: list[ToolResultBlockParam] = [
            {"type": "tool_result", "tool_use_id": use.id, "content": calculator.add_reply(use.input)}
            for use in uses
        ]
        messages.append({"role": "user", "content": results})
    calculator.write_answer(answer)


if __name__ == "__main__":
    main()
