"""Helpers for the harness adapter tests: process checks, a client config, a scripted engine."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult
from harness_adapters.base import ClientConfig

AGENTS = Path(__file__).parent / "agents"
CHAT_AGENT = AGENTS / "chat_agent.py"
TASKSETS = Path(__file__).parents[2] / "harness_adapters" / "tasksets"
PYTHON_BUGS = TASKSETS / "python_bugs" / "tasks.jsonl"


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def agent_cmd(*args: str) -> list[str]:
    return [sys.executable, str(CHAT_AGENT), *args]


def client_config(rollout: str = "r1", port: int = 9) -> ClientConfig:
    base = f"http://127.0.0.1:{port}/rollouts/{rollout}"
    return ClientConfig(
        rollout_id=rollout,
        base_url=base + "/v1",
        api_key="la-test-key",
        reward_url=base + "/reward",
        model="m",
    )


async def wait_ended(app: Appliance, count: int, timeout_s: float = 120.0) -> None:
    """Until ``count`` rollouts of the run have ended (finished or failed)."""
    async with asyncio.timeout(timeout_s):
        while sum(1 for v in app.live.state.rollouts.values() if v.status != "running") < count:
            await app.live.wait_change(app.live.position)


class ScriptedEngine:
    """Stands in for the engine's ``generate``: answers each call with the next scripted text.

    The text is tokenized and ends with ``<|im_end|>``, as a model's answer does; each token has
    log-probability ``LOGPROB``. An answer that is an exception is raised instead (a crash).
    """

    LOGPROB = -0.25

    def __init__(self, tokenizer: Tokenizer, answers: list[str | Exception]) -> None:
        self._tokenizer = tokenizer
        self._answers = list(answers)
        self.calls = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.calls += 1
        if not self._answers:
            raise AssertionError("the harness made more calls than the script has answers")
        answer = self._answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        ids = [*self._tokenizer.encode(answer), self._tokenizer.im_end_id]
        finish = "stop"
        if len(ids) > request.params.max_tokens:
            ids, finish = ids[: request.params.max_tokens], "length"
        for token in ids:
            if request.on_token is not None:
                request.on_token(token, self.LOGPROB)
        return GenerateResult(
            token_ids=tuple(ids), logprobs=(self.LOGPROB,) * len(ids), finish_reason=finish, policy_version=0
        )


def tool_call(command: str, thought: str) -> str:
    """A hermes-style call of mini-swe-agent's ``bash`` tool, as the chat template shows it."""
    payload = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"{thought}\n<tool_call>\n{payload}\n</tool_call>"
