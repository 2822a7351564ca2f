"""Scoring held-out tasks through the running proxy, with training rollouts held back meanwhile.

Owns two things the demo scripts (``scripts/learn_demo.py``, ``scripts/normalization_study.py``)
share:

* ``evaluate``: plays ``retry_arithmetic`` episodes of held-out tasks through the proxy's plain
  ``/v1`` with the admin token, at temperature 0 (greedy) unless told otherwise. Those calls
  belong to no rollout, so they are never trained on. For the temperature to be honoured the
  appliance must not force one (config ``temperature = None``; the training agents then ask for
  ``retry_arithmetic.TEMPERATURE`` themselves).
* ``HeldBackAdapter``: wraps the run's adapter so that rollouts admitted while an evaluation
  runs wait before their agent starts. In sync mode no step can train until those rollouts
  end, so every held-out call of one evaluation is answered by the same policy version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from openai import AsyncOpenAI

from harness_adapters.base import ClientConfig, HarnessAdapter, Task
from harness_adapters.examples.retry_arithmetic import ATTEMPTS, CALL_TIMEOUT_S, Episode, play


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Greedy results over a set of held-out tasks."""

    #: Mean episode reward (halved per retry: 1, 0.5, ...; 0 when never right).
    reward: float
    #: Fraction right at the first attempt.
    first_try: float
    #: Fraction right at some attempt.
    solved: float
    #: Mean calls per episode.
    calls: float
    tasks: int
    seconds: float


def summarize(episodes: Sequence[Episode], seconds: float) -> Evaluation:
    n = max(len(episodes), 1)
    return Evaluation(
        reward=sum(e.reward for e in episodes) / n,
        first_try=sum(1 for e in episodes if e.solved_at == 1) / n,
        solved=sum(1 for e in episodes if e.solved_at is not None) / n,
        calls=sum(e.calls for e in episodes) / n,
        tasks=len(episodes),
        seconds=seconds,
    )


async def evaluate(
    proxy_url: str,
    admin_token: str,
    model: str,
    tasks: Sequence[Task],
    *,
    keep_history: bool = True,
    attempts: int = ATTEMPTS,
    temperature: float = 0.0,
) -> Evaluation:
    """Play one episode of each task, all at once (the engine batches them)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with AsyncOpenAI(
        base_url=f"{proxy_url}/v1", api_key=admin_token, max_retries=0, timeout=CALL_TIMEOUT_S
    ) as oai:
        episodes = await asyncio.gather(
            *(
                play(task, oai, model, keep_history=keep_history, attempts=attempts, temperature=temperature)
                for task in tasks
            )
        )
    return summarize(episodes, loop.time() - started)


class HeldBackAdapter:
    """An adapter whose rollouts wait while ``held`` before running the wrapped adapter."""

    def __init__(self, inner: HarnessAdapter) -> None:
        self.inner = inner
        self.name = inner.name
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        """Rollouts admitted from now on wait (call it synchronously, e.g. from ``on_step``)."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        await self._open.wait()
        return await self.inner.run(task, client)
