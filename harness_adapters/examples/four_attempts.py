"""A fresh-prompt arithmetic agent with up to four attempts: 1 to 4 model calls per rollout.

The task and the first turn are the conversation task's (``retry_arithmetic``: "What is a + b?
Reply with only the number."). A wrong answer gets another attempt from a fresh prompt that
lists the rejected answers (``retry_arithmetic.fresh_prompt``), up to ``ATTEMPTS`` in all, so
every call is a training sample of its own and a rollout has 1 to 4 of them: the variable
number of samples per rollout that makes rollout- and sample-level loss normalization differ
(``scripts/normalization_study.py``). The reward halves with each attempt used (1, 0.5, 0.25,
0.125; 0 when all four are wrong): more groups than with two attempts have a rewarded rollout,
so fewer GRPO groups carry no signal.

Sampling is seeded per call from the rollout id, as in ``retry_arithmetic``, so a run is
reproducible. ``retry_arithmetic.play`` with ``keep_history=False, attempts=ATTEMPTS`` is the
same episode for scoring held-out tasks greedily.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from harness_adapters.base import ClientConfig, Task
from harness_adapters.examples.retry_arithmetic import CALL_TIMEOUT_S, play

#: Calls an episode may make.
ATTEMPTS = 4


async def agent(task: Task, client: ClientConfig) -> float:
    """One episode: up to ``ATTEMPTS`` fresh-prompt calls, stopping at the first right answer."""
    async with AsyncOpenAI(
        base_url=client.base_url, api_key=client.api_key, max_retries=0, timeout=CALL_TIMEOUT_S
    ) as oai:
        episode = await play(
            task, oai, client.model, keep_history=False, attempts=ATTEMPTS, seed=client.rollout_id
        )
    return episode.reward
