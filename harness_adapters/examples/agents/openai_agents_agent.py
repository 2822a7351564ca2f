"""An agent on the OpenAI Agents SDK (``openai-agents``): one ``Agent`` with a function tool.

Run as ``python -m harness_adapters.examples.agents.openai_agents_agent --model M "question"``.
The SDK's default client reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the rollout's
endpoint) and calls the Responses API (``--api chat_completions`` for Chat Completions).
Tracing is off: it would upload traces to OpenAI's platform (the config also sets
``OPENAI_AGENTS_DISABLE_TRACING=1``). A run that uses up its turns, or that the SDK ends
because of what the model did (an answer cut off at the token limit, a call of a tool that does
not exist), is an answer of nothing: reward 0, a training signal, not a crashed rollout. The
answer goes to ``answer.txt``.
"""

from __future__ import annotations

import sys

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    Runner,
    function_tool,
    set_default_openai_api,
    set_tracing_disabled,
)

from harness_adapters.examples.agents import calculator

add = function_tool(calculator.add)


def main() -> None:
    parser = calculator.question_parser(__doc__)
    parser.add_argument("--api", choices=["responses", "chat_completions"], default="responses")
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()
    set_tracing_disabled(True)
    set_default_openai_api(args.api)
    agent = Agent(name="calculator", instructions=calculator.PROMPT, model=args.model, tools=[add])
    try:
        result = Runner.run_sync(agent, args.question, max_turns=args.max_turns)
        answer = str(result.final_output)
    except (MaxTurnsExceeded, ModelBehaviorError) as exc:
        print(f"no answer: {type(exc).__name__}: {exc}", file=sys.stderr)
        answer = ""
    calculator.write_answer(answer)


if __name__ == "__main__":
    main()
