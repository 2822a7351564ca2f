"""An agent on Hugging Face ``smolagents``: a ``CodeAgent`` (it writes Python) with one tool.

Run as ``python -m harness_adapters.examples.agents.smolagents_agent --model M "question"``
(needs ``smolagents``). ``OpenAIServerModel`` is given the rollout's endpoint from
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``. smolagents runs the model's code in its own
restricted local interpreter, in the rollout's working directory; nothing goes to the Hub and
no telemetry is sent unless asked for. Its stock system prompt is long (about 2,000 tokens
with one tool): it needs a model with more context than the tiny test model's 2,048 tokens.
The answer goes to ``answer.txt``.
"""

from __future__ import annotations

import os

from smolagents import CodeAgent, OpenAIServerModel, tool  # type: ignore[import-not-found, unused-ignore]

from harness_adapters.examples.agents import calculator

add = tool(calculator.add)  # type: ignore[no-untyped-call, unused-ignore]


def main() -> None:
    parser = calculator.question_parser(__doc__)
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()
    model = OpenAIServerModel(
        model_id=args.model, api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]
    )
    agent = CodeAgent(tools=[add], model=model, max_steps=args.max_steps, verbosity_level=1)
    calculator.write_answer(str(agent.run(args.question)))


if __name__ == "__main__":
    main()
