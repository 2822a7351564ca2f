"""An example agent: answers ``a + b`` in two model calls through the official ``openai`` client.

The first call offers an ``add`` tool. If the model calls it, the agent runs the tool and sends
the result back; otherwise it tells the model whether its answer was right and asks again. The
reward (1 for the right number, 0.25 for some other number, 0 for none) is reported to the
appliance over HTTP, the way an external harness would.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionFunctionToolParam

from harness_adapters.base import ClientConfig, Task

SYSTEM = "You are a careful calculator. Reply with only the number."
ADD_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
_INT = re.compile(r"-?\d+")


def score(reply: str, answer: int) -> float:
    match = _INT.search(reply)
    if match is None:
        return 0.0
    return 1.0 if int(match.group()) == answer else 0.25


def run_tool(arguments: str) -> str:
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


async def agent(task: Task, client: ClientConfig, *, max_tokens: int = 16) -> None:
    answer = int(task.data["answer"])
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.data["question"]},
    ]
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        first = await oai.chat.completions.create(
            model=client.model, messages=messages, tools=[ADD_TOOL], max_tokens=max_tokens
        )
        reply = first.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if reply.tool_calls:
            for call in reply.tool_calls:
                arguments = call.function.arguments if call.type == "function" else "{}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(arguments)})
        else:
            verdict = "right" if score(reply.content or "", answer) == 1.0 else "wrong"
            messages.append(
                {"role": "user", "content": f"Your answer was {verdict}. Answer again with only the number."}
            )
        second = await oai.chat.completions.create(
            model=client.model, messages=messages, tools=[ADD_TOOL], max_tokens=max_tokens
        )
    reward = score(second.choices[0].message.content or "", answer)
    async with httpx.AsyncClient() as http:
        response = await http.post(
            client.reward_url, json={"reward": reward}, headers={"Authorization": f"Bearer {client.api_key}"}
        )
        response.raise_for_status()
