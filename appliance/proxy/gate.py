"""The serving gate: whether model calls may reach the engine now.

Owns ``ServingGate``, which the scheduler closes while the trainer holds the machine and opens
again after the switch, and the bounded drain before a step: the scheduler waits for the
generations under way, but never longer than its deadline. Past it the generations still
running are preempted (each keeps what it sampled and continues once the gate opens, under the
new weights), so a call that never ends, or an engine request that was lost, cannot hold a
training step (and every call behind it) forever.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from appliance.engines.base import GenerateResult
from contracts.errors import EngineUnavailable


@dataclass(frozen=True, slots=True)
class DrainResult:
    """How a drain ended: ``preempted`` generations were interrupted at the deadline, and
    ``remaining`` calls still counted as in flight when the step went on anyway."""

    timed_out: bool
    preempted: int = 0
    remaining: int = 0


class ServingGate:
    """Open while the engine serves; closed while the trainer holds the machine.

    Calls that arrive while it is closed wait (their connections stay open) up to a limit,
    instead of failing. ``inflight`` counts generations so the scheduler can wait for them.
    Closing with ``preempt=True`` also interrupts the generations under way: each keeps the
    tokens it has sampled, waits for the gate to open, and continues from them under the
    weights served then (a partial rollout); the harness only sees a slower call.
    """

    def __init__(self, hold_timeout_s: float = 3600.0) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.inflight = 0
        self.hold_timeout_s = hold_timeout_s
        self._generations: set[asyncio.Future[GenerateResult]] = set()
        self._preempted: set[asyncio.Future[GenerateResult]] = set()
        #: Generations interrupted by a switch so far.
        self.preemptions = 0

    def close(self, *, preempt: bool = False) -> None:
        self._open.clear()
        if preempt:
            self.preempt()

    def preempt(self) -> int:
        """Interrupt every generation under way (see the class docstring); returns how many."""
        count = 0
        for generation in list(self._generations):
            if not generation.done():
                self._preempted.add(generation)
                self.preemptions += 1
                generation.cancel()
                count += 1
        return count

    def track(self, generation: asyncio.Future[GenerateResult]) -> None:
        self._generations.add(generation)

    def untrack(self, generation: asyncio.Future[GenerateResult]) -> bool:
        """Stop tracking; True if a switch preempted it."""
        self._generations.discard(generation)
        if generation in self._preempted:
            self._preempted.discard(generation)
            return True
        return False

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def enter(self) -> None:
        try:
            if not self._open.is_set():
                await asyncio.wait_for(self._open.wait(), self.hold_timeout_s)
        except TimeoutError:
            raise EngineUnavailable(
                f"the model was busy training for more than {self.hold_timeout_s:g} s; retry the call"
            ) from None
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight = max(0, self.inflight - 1)
        if self.inflight == 0:
            self._idle.set()

    async def drained(self) -> None:
        """Until no generation is in flight (unbounded: the scheduler uses ``drain``)."""
        await self._idle.wait()

    async def drain(self, timeout_s: float, *, grace_s: float = 5.0) -> DrainResult:
        """Wait up to ``timeout_s`` for the generations in flight to end; past it, preempt
        them and wait up to ``grace_s`` more for their calls to step back from the engine."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return DrainResult(timed_out=False)
        preempted = self.preempt()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        return DrainResult(timed_out=True, preempted=preempted, remaining=self.inflight)
