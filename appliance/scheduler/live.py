"""The live projection: the run's state, kept current by following the event log.

Owns one ``RunState`` that a background task folds forward from ``EventStore.subscribe``, and
the waiting primitives the scheduler needs ("until the state has seen position N", "until
anything changes"). Views are rebuilt from events only; nothing writes to the state directly.
"""

from __future__ import annotations

import asyncio

from store.eventstore import EventStore
from store.projections import RunState


class LiveState:
    def __init__(self, store: EventStore, state: RunState, position: int) -> None:
        self.store = store
        self.state = state
        self.position = position
        self._changed = asyncio.Condition()

    async def follow(self) -> None:
        """Apply every new event to the state; runs until the store closes or it is cancelled."""
        async for stored in self.store.subscribe(after=self.position):
            self.state.apply(stored.event, stored.position)
            self.position = stored.position
            async with self._changed:
                self._changed.notify_all()

    async def wait_for(self, position: int) -> None:
        """Return once every event up to ``position`` is folded into the state."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.position >= position)

    async def wait_change(self, after: int) -> None:
        """Return once an event after ``after`` is folded into the state."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.position > after)
