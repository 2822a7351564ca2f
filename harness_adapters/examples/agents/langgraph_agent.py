"""An agent on LangChain and LangGraph: ``ChatOpenAI`` in a ReAct graph with one tool.

Run as ``python -m harness_adapters.examples.agents.langgraph_agent --model M "question"``
(needs ``langchain-openai`` and ``langgraph``). ``ChatOpenAI`` reads ``OPENAI_API_KEY`` and
``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` (the rollout's endpoint) and calls Chat Completions.
LangSmith tracing stays off unless ``LANGSMITH_TRACING`` is set, which the adapter's scrubbed
environment never passes. A graph that hits its step limit is an answer of nothing (reward 0).
The answer goes to ``answer.txt``.
"""

from __future__ import annotations

from langchain_core.tools import tool  # type: ignore[import-not-found, unused-ignore]
from langchain_openai import ChatOpenAI  # type: ignore[import-not-found, unused-ignore]
from langgraph.errors import GraphRecursionError  # type: ignore[import-not-found, unused-ignore]
from langgraph.prebuilt import create_react_agent  # type: ignore[import-not-found, unused-ignore]

from harness_adapters.examples.agents import calculator


@tool  # type: ignore[untyped-decorator, unused-ignore]
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def main() -> None:
    parser = calculator.question_parser(__doc__)
    parser.add_argument("--max-steps", type=int, default=8, help="LangGraph's recursion limit")
    args = parser.parse_args()
    graph = create_react_agent(ChatOpenAI(model=args.model, max_retries=2), [add], prompt=calculator.PROMPT)
    try:
        state = graph.invoke({"messages": [("user", args.question)]}, {"recursion_limit": args.max_steps})
        answer = str(state["messages"][-1].content)
    except GraphRecursionError:
        answer = ""
    calculator.write_answer(answer)


if __name__ == "__main__":
    main()
