"""The chaos test's agent: a few chat calls, each measured, and faults as its plan says.

Runs with the python adapter inside the appliance (``--agent tests.appliance.chaos_agent:agent``)
and reads its ``FaultPlan`` from ``$CHAOS_PLAN`` (see ``tests/appliance/chaos_run.py``). Per
rollout it makes one to three calls, each with a sampling seed drawn from the plan (so the test
knows which engine fault a call met), and appends each call's wall time, outcome and call id to
``<out_dir>/calls.jsonl`` however the call ends, also when the agent is cancelled mid-call.
Harness faults: it raises, returns without a reward, or hangs until the rollout's timeout. A
503 (the model held by training past ``hold_timeout_s``) is retried once, as agents do.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
from openai import APIConnectionError, APIStatusError, AsyncOpenAI

from harness_adapters.base import ClientConfig, Task
from tests.appliance.chaos_run import PLAN_ENV, FaultPlan, append_line

_plans: dict[str, FaultPlan] = {}


def _plan() -> FaultPlan:
    path = os.environ[PLAN_ENV]
    if path not in _plans:
        _plans[path] = FaultPlan.load(Path(path))
    return _plans[path]


async def _call(oai: AsyncOpenAI, plan: FaultPlan, client: ClientConfig, question: str, seed: int) -> str:
    """One chat call, measured and recorded whatever happens to it."""
    started = time.monotonic()
    outcome, call_id = "cancelled", ""
    try:
        answer = await oai.chat.completions.create(
            model=client.model,
            messages=[{"role": "user", "content": question}],
            max_tokens=8,
            seed=seed,
        )
        outcome, call_id = "ok", answer.id.removeprefix("chatcmpl-")
        return answer.choices[0].message.content or ""
    except APIStatusError as exc:
        outcome = f"http {exc.status_code}"
        raise
    except APIConnectionError:
        outcome = "connection"
        raise
    finally:
        append_line(
            Path(plan.out_dir) / "calls.jsonl",
            {
                "rollout": client.rollout_id,
                "seed": seed,
                "engine_fault": plan.engine_fault(seed)[0],
                "wall_s": time.monotonic() - started,
                "outcome": outcome,
                "call_id": call_id,
            },
        )


async def agent(task: Task, client: ClientConfig) -> float | None:
    plan = _plan()
    fault, rng = plan.agent_fault(client.rollout_id)
    calls = rng.randint(1, 3)
    fails_at = rng.randrange(calls + 1)  # raise / hang before this call (== calls: after the last)
    if fault != "none":
        plan.record("agent", fault, rollout=client.rollout_id, at_call=fails_at)
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        for n in range(calls):
            if n == fails_at and fault == "raise":
                raise RuntimeError(f"chaos: the agent of {client.rollout_id} failed")
            if n == fails_at and fault == "hang":
                await asyncio.sleep(3600)  # until the rollout's timeout cancels it
            question = f"{task.data.get('question', task.id)} (call {n})"
            try:
                await _call(oai, plan, client, question, rng.getrandbits(62))
            except APIStatusError as exc:
                if exc.status_code != 503:
                    raise
                await _call(oai, plan, client, question, rng.getrandbits(62))
    if fails_at == calls and fault == "raise":
        raise RuntimeError(f"chaos: the agent of {client.rollout_id} failed after its calls")
    if fails_at == calls and fault == "hang":
        await asyncio.sleep(3600)
    if fault == "no_reward":
        return None
    reward = rng.random()  # rewards that differ within a group: the steps have a gradient
    if rng.random() < 0.5:
        return reward
    async with httpx.AsyncClient() as http:
        response = await http.post(
            client.reward_url, json={"reward": reward}, headers={"Authorization": f"Bearer {client.api_key}"}
        )
        response.raise_for_status()
    return None
