"""Fast deterministic stand-ins for the engine's ``generate``, for the proxy's limit, load and
fuzz tests: the proxy's cost is what they measure, not the model's.

``FastEngine`` answers every call with the same few tokens, handing each to ``on_token`` and
yielding to the event loop between them (so concurrent streams interleave); ``say(text)``
changes the answer; ``hold(n)`` makes each generation wait after its first token until n run
at once. ``HeldEngine`` starts every generation and then waits until the test releases it, so
a test can hold calls open for as long as it needs.
"""

from __future__ import annotations

import asyncio

from appliance.chat.tokenizer import Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult

LOGPROB = -0.5


class FastEngine:
    """Every call samples ``text`` then ``<|im_end|>``; counts the generations running at once."""

    def __init__(self, tokenizer: Tokenizer, text: str = "four") -> None:
        self._tokenizer = tokenizer
        self._ids = [*tokenizer.encode(text), tokenizer.im_end_id]
        self.running = 0
        self.peak = 0
        self.calls = 0
        self._hold_until = 0
        self._all_started = asyncio.Event()

    def say(self, text: str) -> None:
        """From now on, every call samples ``text`` then ``<|im_end|>``."""
        self._ids = [*self._tokenizer.encode(text), self._tokenizer.im_end_id]

    def hold(self, count: int) -> None:
        """From now on, generations wait after their first token until ``count`` run at once."""
        self._hold_until = count
        self._all_started = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.calls += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        if self.running >= self._hold_until:
            self._all_started.set()
        try:
            ids = self._ids[: request.params.max_tokens]
            for i, token in enumerate(ids):
                if request.on_token is not None:
                    request.on_token(token, LOGPROB)
                if i == 0:
                    await self._all_started.wait()
                await asyncio.sleep(0)
        finally:
            self.running -= 1
        finish = "stop" if ids[-1] == self._ids[-1] else "length"
        return GenerateResult(
            token_ids=tuple(ids), logprobs=(LOGPROB,) * len(ids), finish_reason=finish, policy_version=0
        )


class HeldEngine(FastEngine):
    """Like ``FastEngine``, but every generation waits for ``release`` before it samples."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.release = asyncio.Event()
        self.waiting = 0
        self._changed = asyncio.Condition()

    async def waiting_for(self, count: int, timeout_s: float = 10.0) -> None:
        """Until ``count`` generations wait for ``release``."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self.waiting >= count)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        async with self._changed:
            self.waiting += 1
            self._changed.notify_all()
        try:
            await self.release.wait()
        finally:
            self.waiting -= 1
        return await super().generate(request)
