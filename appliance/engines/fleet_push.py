"""The engine fleet's weight tee: one bucketed push read once and fed to every replica.

Owns reading the trainer's bucket stream once and offering each bucket to every replica's own
stream (``Feed``), reading the next bucket only once each replica has asked for it (or closed
its stream, or ended): each bucket lives in a file the next bucket overwrites
(``trainer.buckets``). A replica that fails does not hold up the others: its stream is dropped
and the push goes on without it. A replica given a deadline (a remote one) that has not taken
the whole push by then is dropped too (``ReplicaTooSlow``): its stream ends in an error when it
asks for more, its load is left to end on its own, and the push goes on. What a replica's
outcome means for the fleet (its version, whether it is behind) is ``appliance.engines.fleet``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

from contracts.errors import EngineUnavailable
from trainer.buckets import WeightBucket, close_stream


class ReplicaTooSlow(EngineUnavailable):
    """A replica did not take a weight update within its deadline; the update went on without
    it (it is behind until it catches up)."""


#: One replica's load: given its stream, takes the push.
Load = Callable[[AsyncIterator[WeightBucket]], Awaitable[None]]


async def tee_push(
    buckets: AsyncIterator[WeightBucket], loads: Sequence[Load], deadlines: Sequence[float | None]
) -> list[BaseException | None]:
    """Feed ``buckets`` to every load at once; returns each load's outcome in order (None: it
    took the push; ``ReplicaTooSlow``: it was dropped past its deadline, seconds from now, None:
    none). Raises the source's own error, once every load that was not dropped has ended. The
    source is closed when the push ends."""
    changed = asyncio.Event()
    feeds = [Feed(changed) for _ in loads]
    streams = [feed.stream() for feed in feeds]
    tasks = [asyncio.ensure_future(load(stream)) for load, stream in zip(loads, streams, strict=True)]
    for task in tasks:
        task.add_done_callback(lambda _: changed.set())
    started = time.monotonic()
    ends = [None if d is None else started + d for d in deadlines]
    dropped: list[ReplicaTooSlow | None] = [None] * len(tasks)
    source = aiter(buckets)
    source_error: Exception | None = None
    ended = False  # the last bucket (or the end of the stream) was offered

    def waiting(i: int) -> bool:
        return not tasks[i].done() and dropped[i] is None

    try:
        while any(waiting(i) for i in range(len(tasks))):
            try:
                bucket: WeightBucket | None = await anext(source)
            except StopAsyncIteration:
                bucket = None
            except Exception as exc:
                source_error = exc
                break
            for i, feed in enumerate(feeds):
                if waiting(i):
                    feed.offer(bucket)
            # The next bucket overwrites this one: wait until no replica still reads it.
            while True:
                changed.clear()
                now = time.monotonic()
                for i, end in enumerate(ends):
                    if waiting(i) and end is not None and now >= end and not feeds[i].done:
                        too_slow = ReplicaTooSlow(
                            f"it did not take the weight update within {deadlines[i]:g} s"
                        )
                        dropped[i] = too_slow
                        feeds[i].drop(too_slow)
                pending = [i for i in range(len(tasks)) if waiting(i) and not feeds[i].done]
                if not pending:
                    break
                timeouts = [end for i in pending if (end := ends[i]) is not None]
                timeout = max(0.0, min(timeouts) - time.monotonic()) if timeouts else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout)
            if bucket is None or bucket.last:
                ended = True
                break
    finally:
        # A replica that asks for more gets the end of the stream after the last bucket, and an
        # error when the push stopped short (the source failed, or this task was cancelled);
        # then every load that was not dropped ends and its stream is closed.
        for i, feed in enumerate(feeds):
            if waiting(i):
                reason = source_error if source_error is not None else "cancelled"
                feed.offer(
                    None if ended else EngineUnavailable(f"the fleet's weight push stopped ({reason})")
                )
        kept = [task for i, task in enumerate(tasks) if dropped[i] is None]
        if kept:
            await asyncio.wait(kept)
        for i, stream in enumerate(streams):
            if dropped[i] is None:
                with contextlib.suppress(Exception):
                    await stream.aclose()
        await close_stream(buckets)
    if source_error is not None:
        raise source_error
    return [dropped[i] if dropped[i] is not None else _outcome(task) for i, task in enumerate(tasks)]


def _outcome(task: asyncio.Future[None]) -> BaseException | None:
    return asyncio.CancelledError() if task.cancelled() else task.exception()


class Feed:
    """One replica's stream of a push: the buckets the tee offers, one at a time."""

    def __init__(self, changed: asyncio.Event) -> None:
        self._changed = changed
        self._offered = asyncio.Event()
        self._item: WeightBucket | Exception | None = None
        #: True when the replica is done with the last bucket offered (it asked for the next
        #: one, or its stream is closed).
        self.done = True
        self._closed = False

    def offer(self, item: WeightBucket | Exception | None) -> None:
        """The next bucket; None ends the stream, an exception is raised in the replica."""
        if self._closed:
            return
        self._item, self.done = item, False
        self._offered.set()

    def drop(self, error: Exception) -> None:
        """The push goes on without this replica: when it asks for more, ``error`` is raised."""
        self._item, self.done, self._closed = error, True, True
        self._offered.set()

    def _release(self) -> None:
        self.done = True
        self._changed.set()

    async def stream(self) -> AsyncGenerator[WeightBucket, None]:
        try:
            while True:
                await self._offered.wait()
                self._offered.clear()
                item = self._item
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
                self._release()  # asked for the next one: done with this one
        finally:
            self._closed = True
            self._release()
