"""A call on a remote replica, bounded: it ends when its replica stalls or is found gone.

Owns ``bounded``: the engine's ``generate`` run beside two ends other than its own: a stall (no
token handed over for ``stall_s``, counted from the call's start, then from each token) and
``ended``, a future that whoever watches the replica resolves with why (its ``/health`` probe
failed, it was lost). Either cancels the generation and raises ``EngineUnavailable`` with the
reason; the fleet then serves the call on another replica, or, after tokens, ends it with
``ReplicaLost``. Without this a replica cut off without a reset (a cable pulled, a partition)
holds its calls until the operating system gives up on the connection.

Local replicas are not bounded here: their own supervision ends their calls when they die.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from appliance.engines.base import GenerateResult
from contracts.errors import EngineUnavailable


async def bounded(
    generation: Awaitable[GenerateResult],
    *,
    stall_s: float,
    progress: Callable[[], float],
    ended: asyncio.Future[str],
) -> GenerateResult:
    """``generation``'s result, unless ``progress()`` (the ``time.monotonic()`` of the call's
    start or of its last token) falls ``stall_s`` behind, or ``ended`` is resolved, first."""
    task = asyncio.ensure_future(generation)
    try:
        while True:
            left = progress() + stall_s - time.monotonic()
            if left <= 0:
                reason = f"it handed over no token for {stall_s:g} s (remote_stall_s)"
                break
            waited: set[asyncio.Future[object]] = {task, ended}  # type: ignore[arg-type]
            done, _ = await asyncio.wait(waited, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if ended.done():
                reason = ended.result()
                break
    finally:
        if not task.done():  # ended here, or the caller was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    raise EngineUnavailable(reason)
