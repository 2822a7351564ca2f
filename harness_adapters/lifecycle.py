"""Retries for infrastructure failures, and a concurrency limit, around any adapter.

Owns the two lifecycle rules that do not depend on the kind of agent, for the rollout
controller to apply around ``adapter.run``:

* ``run_with_retries``: an ``InfraError`` raised before the agent started (``started`` False:
  an executable missing, no rollout directory, the Kubernetes API refusing a Job) is retried
  with exponential back-off, up to ``max_attempts`` in all; nothing of the rollout was recorded
  yet, so the retry reuses the same rollout id. An ``InfraError`` after the agent started, an
  ``AgentFailed``, a timeout or any other exception is never retried: the agent's calls are
  recorded and a rerun would mix two attempts into one rollout.
* ``ConcurrencyLimited``: at most ``limit`` rollouts inside the adapter at once. Note: under
  the controller's ``wait_for(timeout)`` the wait for a slot counts against the rollout's
  timeout; a controller should take the slot before it starts the clock (see the README).
  ``Slots`` is the same limit for an adapter to keep itself (its ``max_concurrency`` option).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from harness_adapters.base import ClientConfig, HarnessAdapter, InfraError, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    #: Attempts in all (1: never retry).
    max_attempts: int = 3
    #: Seconds before the first retry; doubled for each further one, up to ``max_backoff_s``.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** (attempt - 1))


async def run_with_retries(
    adapter: HarnessAdapter, task: Task, client: ClientConfig, policy: RetryPolicy
) -> float | None:
    """``adapter.run``, retrying infrastructure failures that happened before the agent started."""
    attempt = 1
    while True:
        try:
            return await adapter.run(task, client)
        except InfraError as exc:
            if exc.started or attempt >= policy.max_attempts:
                if attempt == 1:
                    raise
                raise InfraError(f"{exc.reason} (after {attempt} attempts)", started=exc.started) from exc
            delay = policy.delay(attempt)
            log.warning(
                "rollout %s: infrastructure failure (attempt %d of %d), retrying in %.3g s: %s",
                client.rollout_id,
                attempt,
                policy.max_attempts,
                delay,
                exc.reason,
            )
            await asyncio.sleep(delay)
            attempt += 1


class ConcurrencyLimited:
    """``adapter`` with at most ``limit`` rollouts running in it at once."""

    def __init__(self, adapter: HarnessAdapter, limit: int) -> None:
        if limit < 1:
            raise ValueError("the concurrency limit must be at least 1")
        self.adapter = adapter
        self.name = adapter.name
        self._slots = asyncio.Semaphore(limit)
        self.running = 0

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        async with self._slots:
            self.running += 1
            try:
                return await self.adapter.run(task, client)
            finally:
                self.running -= 1


class Slots:
    """At most ``limit`` rollouts at once (None: no limit), entered around each one with
    ``async with``: the ``max_concurrency`` option of an adapter."""

    def __init__(self, limit: int | None) -> None:
        self._semaphore = asyncio.Semaphore(limit) if limit else None

    async def __aenter__(self) -> None:
        if self._semaphore is not None:
            await self._semaphore.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        if self._semaphore is not None:
            self._semaphore.release()
