"""Retries only for infrastructure failures before the agent started; a concurrency limit."""

from __future__ import annotations

import asyncio

import pytest

from harness_adapters.base import AgentFailed, ClientConfig, InfraError, Task
from harness_adapters.lifecycle import ConcurrencyLimited, RetryPolicy, run_with_retries
from tests.harness_adapters.support import client_config

FAST = RetryPolicy(max_attempts=3, backoff_s=0.001)


class Flaky:
    name = "flaky"

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = list(failures)
        self.attempts = 0

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        self.attempts += 1
        if self.failures:
            raise self.failures.pop(0)
        return 1.0


async def test_infrastructure_failures_before_start_are_retried() -> None:
    flaky = Flaky([InfraError("no node"), InfraError("API 503")])
    assert await run_with_retries(flaky, Task("t"), client_config(), FAST) == 1.0
    assert flaky.attempts == 3


async def test_retries_are_capped() -> None:
    flaky = Flaky([InfraError("API 503")] * 5)
    with pytest.raises(InfraError, match=r"API 503 \(after 3 attempts\)"):
        await run_with_retries(flaky, Task("t"), client_config(), FAST)
    assert flaky.attempts == 3


@pytest.mark.parametrize(
    "failure", [InfraError("evicted", started=True), AgentFailed("exit code 1"), ValueError("bug")]
)
async def test_other_failures_are_never_retried(failure: Exception) -> None:
    flaky = Flaky([failure])
    with pytest.raises(type(failure)):
        await run_with_retries(flaky, Task("t"), client_config(), FAST)
    assert flaky.attempts == 1


def test_backoff_doubles_up_to_a_cap() -> None:
    policy = RetryPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay(a) for a in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


async def test_concurrency_limit() -> None:
    peak = 0

    class Slow:
        name = "slow"

        async def run(self, task: Task, client: ClientConfig) -> float | None:
            nonlocal peak
            peak = max(peak, limited.running)
            await asyncio.sleep(0.01)
            return None

    limited = ConcurrencyLimited(Slow(), 3)
    await asyncio.gather(*(limited.run(Task("t"), client_config(f"r{i}")) for i in range(20)))
    assert peak == 3 and limited.name == "slow"
