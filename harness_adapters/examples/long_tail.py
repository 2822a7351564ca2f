"""An example agent with SWE-agent-like timing: a long-tailed number of calls and tool latency.

Most rollouts make two or three calls; a few make many. Between calls the agent "runs a tool"
(sleeps for a long-tailed time), as a coding agent waits for commands. The task is the
arithmetic one, so the reward means the same as in ``arithmetic``. Timing is drawn from the
task id and the rollout id, so a run is reproducible.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
from openai import AsyncOpenAI

from harness_adapters.base import ClientConfig, Task
from harness_adapters.examples.arithmetic import SYSTEM, score

#: Seconds of median tool latency; each wait is lognormal around it.
TOOL_MEDIAN_S = 0.05


def plan(task: Task, rollout_id: str) -> tuple[int, list[float]]:
    """(number of calls, tool waits between them): Pareto-tailed calls, lognormal waits."""
    rng = random.Random(f"{task.id}/{rollout_id}")
    calls = min(12, 1 + int(rng.paretovariate(1.5)))
    waits = [TOOL_MEDIAN_S * rng.lognormvariate(0.0, 1.0) for _ in range(calls - 1)]
    return calls, waits


async def agent(task: Task, client: ClientConfig, *, max_tokens: int = 16) -> None:
    answer = int(task.data["answer"])
    calls, waits = plan(task, client.rollout_id)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.data["question"]},
    ]
    reply = ""
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        for i in range(calls):
            response = await oai.chat.completions.create(
                model=client.model, messages=messages, max_tokens=max_tokens
            )
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            if i < calls - 1:
                await asyncio.sleep(waits[i])
                verdict = "right" if score(reply, answer) == 1.0 else "wrong"
                messages.append({"role": "user", "content": f"The checker says {verdict}. Answer again."})
    async with httpx.AsyncClient() as http:
        posted = await http.post(
            client.reward_url,
            json={"reward": score(reply, answer)},
            headers={"Authorization": f"Bearer {client.api_key}"},
        )
        posted.raise_for_status()
