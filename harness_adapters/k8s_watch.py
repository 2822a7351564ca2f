"""Watching a run's Kubernetes Jobs, and pacing their submission.

Owns ``JobPoller`` (one LIST of the run's Jobs per interval, by label selector, shared by every
rollout waiting on a Job, so the API load does not grow with the number of rollouts),
``job_outcome`` (a Job's status read as succeeded / failed / running), and ``RateLimiter`` (a
token bucket for creates). It knows nothing of tasks or rewards. The client is synchronous:
each call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from harness_adapters.base import InfraError

log = logging.getLogger(__name__)


class RateLimiter:
    """A token bucket: ``rate`` acquisitions per second on average, ``burst`` at once."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = self._clock()
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return
                await asyncio.sleep((1.0 - self._tokens) / self.rate)


class JobPoller:
    """One LIST of the run's Jobs per interval, shared by every waiting rollout."""

    def __init__(
        self, batch: Any, namespace: str, selector: str, interval_s: float, failures: int, timeout_s: float
    ) -> None:
        self._batch, self._namespace, self._selector = batch, namespace, selector
        self._interval_s, self._max_failures, self._timeout_s = interval_s, failures, timeout_s
        self.jobs: dict[str, Any] = {}
        self.error: InfraError | None = None
        self._changed = asyncio.Condition()
        self._watched: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def wait(self, name: str) -> None:
        """Until the next poll round (raising the poller's error, if it gave up)."""
        self._watched.add(name)
        if self._task is None or self._task.done():
            self.error = None
            self._task = asyncio.create_task(self._loop(), name="kubernetes job poller")
        async with self._changed:
            await self._changed.wait()
        if self.error is not None:
            raise self.error

    def forget(self, name: str) -> None:
        self._watched.discard(name)
        self.jobs.pop(name, None)
        if not self._watched and self._task is not None:
            self._task.cancel()  # nothing left to watch: no poller outlives the rollouts
            self._task = None

    async def _loop(self) -> None:
        failures = 0
        while self._watched:
            await asyncio.sleep(self._interval_s)
            try:
                listed = await asyncio.to_thread(
                    self._batch.list_namespaced_job,
                    self._namespace,
                    label_selector=self._selector,
                    _request_timeout=self._timeout_s,
                )
                self.jobs = {job.metadata.name: job for job in listed.items or []}
                failures = 0
            except Exception as exc:
                failures += 1
                log.warning("listing Jobs failed (%d in a row): %s", failures, exc)
                if failures >= self._max_failures:
                    self.error = InfraError(f"Kubernetes API: listing Jobs failed: {exc}", started=True)
            async with self._changed:
                self._changed.notify_all()
            if self.error is not None:
                return


def job_outcome(job: Any) -> str | None:
    """``"succeeded"``, ``"failed"`` or None (still running) from a Job's status."""
    status = job.status
    if status is None:
        return None
    for condition in status.conditions or []:
        if condition.status == "True" and condition.type in ("Complete", "SuccessCriteriaMet"):
            return "succeeded"
        if condition.status == "True" and condition.type in ("Failed", "FailureTarget"):
            return "failed"
    if status.succeeded:
        return "succeeded"
    if status.failed:
        return "failed"
    return None
