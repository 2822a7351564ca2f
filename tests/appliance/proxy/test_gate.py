"""The serving gate's bounded drain: generations that do not end are preempted at the deadline."""

from __future__ import annotations

import asyncio

from appliance.engines.base import GenerateResult
from appliance.proxy.gate import ServingGate


async def _never() -> GenerateResult:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_drain_returns_at_once_when_nothing_runs() -> None:
    gate = ServingGate()
    gate.close()
    result = await asyncio.wait_for(gate.drain(5.0), 1.0)
    assert not result.timed_out and result.preempted == 0


async def test_a_generation_that_never_ends_is_preempted_at_the_deadline() -> None:
    gate = ServingGate()
    await gate.enter()
    generation = asyncio.ensure_future(_never())
    gate.track(generation)

    async def call() -> bool:
        try:
            await generation
        except asyncio.CancelledError:
            return gate.untrack(generation)
        finally:
            gate.leave()
        return False

    caller = asyncio.ensure_future(call())
    gate.close()
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await asyncio.wait_for(gate.drain(0.2, grace_s=1.0), 5.0)
    assert result.timed_out
    assert result.preempted == 1
    assert result.remaining == 0
    assert 0.2 <= loop.time() - started < 1.0
    assert await caller is True, "the call must learn that a switch preempted it"
    assert gate.inflight == 0


async def test_a_leaked_count_does_not_hold_the_drain_past_deadline_and_grace() -> None:
    gate = ServingGate()
    await gate.enter()  # a call that entered and never left (no generation to preempt)
    gate.close()
    result = await asyncio.wait_for(gate.drain(0.1, grace_s=0.1), 5.0)
    assert result.timed_out and result.preempted == 0 and result.remaining == 1
