"""The child side of ``PythonAdapter(isolation="process")``: one agent function, one rollout.

Run as ``python -m harness_adapters.python_worker package.module:function`` by the ``command``
adapter. It rebuilds the ``Task`` from ``$TASK_JSON`` and the ``ClientConfig`` from the
rollout's environment, runs the function with ``asyncio.run``, and writes a returned reward to
``$LA_REWARD_FILE`` (the adapter reads it back). An exception ends it with exit code 1 and the
traceback on stderr, which the adapter records as the failure's reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import load_agent


def client_from_env(env: dict[str, str]) -> ClientConfig:
    return ClientConfig(
        rollout_id=env["LA_ROLLOUT_ID"],
        base_url=env["OPENAI_BASE_URL"],
        api_key=env["OPENAI_API_KEY"],
        reward_url=env["LA_REWARD_URL"],
        model=env["LA_MODEL"],
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m harness_adapters.python_worker package.module:function\n")
        return 2
    agent = load_agent(argv[1])
    raw = json.loads(Path(os.environ["TASK_JSON"]).read_text())
    task = Task(id=raw["id"], data=raw["data"])

    async def run() -> float | None:
        return await agent(task, client_from_env(dict(os.environ)))

    reward = asyncio.run(run())
    if reward is not None:
        Path(os.environ["LA_REWARD_FILE"]).write_text(f"{float(reward)!r}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
