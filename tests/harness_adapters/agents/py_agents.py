"""Test agents for the ``python`` adapter (in this process, or in a worker process).

``task.data["behavior"]`` picks what the agent does, as for ``chat_agent.py``: ``ok`` (one
call through the official ``openai`` client, then return ``task.data["reward"]``), ``hang``
(start ``chat_agent.py`` in its hanging mode through ``run_process``, which owns the tree),
``crash`` (raise).
"""

from __future__ import annotations

import sys
from pathlib import Path

from openai import AsyncOpenAI

from harness_adapters.base import ClientConfig, Task
from harness_adapters.process import run_process, scrubbed_env

CHAT_AGENT = Path(__file__).with_name("chat_agent.py")


async def agent(task: Task, client: ClientConfig) -> float | None:
    behavior = task.data.get("behavior", "ok")
    if behavior == "crash":
        raise RuntimeError("boom-crash-marker")
    if behavior == "hang":
        pid_dir = str(task.data["pid_dir"])
        logs = Path(pid_dir)
        extra = {"TASK_BEHAVIOR": "hang", "TASK_PID_DIR": pid_dir, "LA_ROLLOUT_ID": client.rollout_id}
        env = scrubbed_env(extra)
        await run_process(
            [sys.executable, str(CHAT_AGENT)],
            cwd=logs,
            env=env,
            stdout_path=logs / f"{client.rollout_id}.out",
            stderr_path=logs / f"{client.rollout_id}.err",
            grace_s=1.0,
        )
        return None
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        await oai.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
    reward = task.data.get("reward")
    return None if reward is None else float(reward)
