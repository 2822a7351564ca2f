"""Generations against weight changes in the vLLM engine: who waits for whom.

Owns ``GenerationGate``: generations run together; a weight push, sleep, wake or restart
(``exclusive``) waits until none runs, and generations that arrive meanwhile wait until it is
over, so every token carries the version that sampled it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class GenerationGate:
    """Generations run together; a weight swap or sleep (``exclusive``) waits until none runs,
    and new generations wait while one is pending. No awaits in ``finally``: cancel-safe."""

    def __init__(self) -> None:
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._exclusive = asyncio.Lock()

    async def enter(self) -> None:
        """Start a generation (``leave`` when it ends), once no swap or sleep is pending."""
        while not self._open.is_set():
            await self._open.wait()
        self._active += 1
        self._idle.clear()

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._exclusive:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()
