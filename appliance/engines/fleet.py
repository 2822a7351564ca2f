"""The engine fleet: one ``Engine`` over K replica engines, so the appliance serves from several.

Owns three things and nothing else. Routing: every call of a rollout goes to the replica its
first call went to (``GenerateRequest.affinity``, the rollout id: that replica's prefix cache
holds the rollout's earlier turns), a new rollout to the least loaded live replica (fewest
requests in flight, then fewest rollouts assigned), a call without a key to the least loaded.
Failover: a replica that cannot serve gets no new rollouts, and a rollout whose replica failed
moves. Fan-out: weights, sleep and wake go to every replica at once, a bucketed push through a
tee (one reader of the trainer's stream, one stream per replica). The replicas themselves, their
processes and restarts (``VLLMEngine`` restarts its server and re-pushes file-held weights), where
they run (``appliance.engines.factory``) and when rollouts end (the controller calls ``release``
through the rollout registry) are not the fleet's.

A replica is *live* when it is up (no ``down_reason``: not closed, not restarting, not given
up), awake, does not need weights, serves the fleet's policy version, and has not failed a call
in the last ``failure_cooldown_s``. Only live replicas get new rollouts (when none is live, those
only cooling down still do); a rollout pinned to a replica that is no longer live moves at its
next call. A call that fails on its replica with ``EngineUnavailable`` fails as it would on one
engine (the proxy answers a retryable 503), its rollout loses the replica, and the replica cools
down; its next call goes elsewhere (a cold prefix cache there: only slower).

Weights: every replica gets every push. The trainer's bucket stream can be read once, and each
bucket lives in a file the next bucket overwrites (``trainer.buckets``), so the tee
offers a bucket to every replica and reads the next only once each has asked for it (or closed
its stream, or ended). A replica that fails does not hold up the others: its stream is dropped
and the push goes on without it. Afterwards the fleet serves ``version`` if any replica took it;
a replica that did not is stale: it gets no calls, and ``needs_weights`` is True while it is up,
so the scheduler pushes the published version to all again. Failures of replicas that are down
(a vLLM server dying under the push) are logged and left out; any other failure is raised once
every replica has finished. Sleep and wake go to every replica, down ones included (a
restarting ``VLLMEngine`` keeps the state and restarts asleep).

Invariant: ``policy_version`` is the fleet's version, which every replica that gets calls serves
(all replicas hold it after a push that raised nothing), so a token's recorded version is the
one that sampled it. Not thread-safe: the event loop's only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from appliance.engines.base import Engine, GenerateRequest, GenerateResult, WeightGroupMember
from contracts.errors import EngineUnavailable
from trainer.buckets import WeightBucket, close_stream

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Affinities kept at most (least recently used first out); ``release`` normally forgets them
#: when their rollout ends, the bound only guards against keys nobody releases.
MAX_AFFINITIES = 65536


@runtime_checkable
class Supervised(Protocol):
    """An engine that says when it cannot serve whatever it is asked (``TorchEngine``,
    ``VLLMEngine``); a replica without it counts as up."""

    @property
    def down_reason(self) -> str | None:
        """Why the engine cannot serve now (closed, not started, restarting, gave up); None
        while it is up. Sleep and ``needs_weights`` are reported apart."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaStatus:
    """One replica as the fleet sees it now."""

    index: int
    #: "live", "cooling down", "stale", "needs weights", "asleep", or why it is down.
    state: str
    policy_version: int
    inflight: int
    rollouts: int


@dataclass(slots=True, eq=False)
class _Replica:
    index: int
    engine: Engine
    #: Requests the fleet has sent it that have not returned.
    inflight: int = 0
    #: Rollouts (affinities) assigned to it.
    rollouts: int = 0
    #: ``time.monotonic()`` of its last call that failed with ``EngineUnavailable``.
    failed_at: float | None = None


def down_reason(engine: Engine) -> str | None:
    return engine.down_reason if isinstance(engine, Supervised) else None


class EngineFleet:
    """An ``Engine`` over ``replicas`` (started, closed, pushed and put to sleep together).

    The replicas must serve the same model at the same ``policy_version``. ``failure_cooldown_s``
    is how long a replica whose call failed gets no new rollouts; ``max_affinities`` bounds the
    rollouts remembered (least recently used out).
    """

    def __init__(
        self,
        replicas: Sequence[Engine],
        *,
        failure_cooldown_s: float = 5.0,
        max_affinities: int = MAX_AFFINITIES,
    ) -> None:
        if not replicas:
            raise ValueError("an engine fleet needs at least one replica")
        versions = {engine.policy_version for engine in replicas}
        if len(versions) != 1:
            raise ValueError(f"the replicas serve different policy versions {sorted(versions)}")
        if max_affinities < 1:
            raise ValueError(f"max_affinities must be at least 1, got {max_affinities}")
        self._replicas = [_Replica(i, engine) for i, engine in enumerate(replicas)]
        self._version = versions.pop()
        self._cooldown_s = failure_cooldown_s
        self._max_affinities = max_affinities
        #: Affinity key -> replica index, least recently used first.
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._started = False
        self._closed = False

    # -- what the fleet is ------------------------------------------------------------------

    @property
    def replicas(self) -> tuple[Engine, ...]:
        return tuple(replica.engine for replica in self._replicas)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return min(replica.engine.max_context for replica in self._replicas)

    @property
    def needs_weights(self) -> bool:
        """A replica is up but lacks the fleet's weights (it lost a bucketed version, or missed
        a push while it was down or failed): the scheduler then pushes to all."""
        if self._closed:
            return False
        return any(
            replica.engine.needs_weights
            or (
                down_reason(replica.engine) is None
                and not replica.engine.is_sleeping
                and replica.engine.policy_version != self._version
            )
            for replica in self._replicas
        )

    @property
    def is_sleeping(self) -> bool:
        """Whether the replicas that are up sleep (all of them, when none is up)."""
        up = [r for r in self._replicas if down_reason(r.engine) is None] or self._replicas
        return any(replica.engine.is_sleeping for replica in up)

    def replica_of(self, affinity: str) -> int | None:
        """The index of the replica ``affinity``'s calls go to, if it has one."""
        return self._affinity.get(affinity)

    def status(self) -> tuple[ReplicaStatus, ...]:
        now = time.monotonic()
        return tuple(
            ReplicaStatus(
                index=r.index,
                state=self._state(r, now),
                policy_version=r.engine.policy_version,
                inflight=r.inflight,
                rollouts=r.rollouts,
            )
            for r in self._replicas
        )

    def _state(self, replica: _Replica, now: float) -> str:
        engine = replica.engine
        if (reason := down_reason(engine)) is not None:
            return reason
        if engine.is_sleeping:
            return "asleep"
        if engine.needs_weights:
            return "needs weights"
        if engine.policy_version != self._version:
            return "stale"
        if replica.failed_at is not None and now - replica.failed_at < self._cooldown_s:
            return "cooling down"
        return "live"

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every replica at once; if one fails, close them all and raise its error."""
        if self._closed:
            raise EngineUnavailable("the engine fleet is closed; create a new one")
        results = await asyncio.gather(*(r.engine.start() for r in self._replicas), return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self._started = True

    async def close(self) -> None:
        """Close every replica (each fails its pending requests). Idempotent."""
        if self._closed:
            return
        self._closed = True
        results = await asyncio.gather(*(r.engine.close() for r in self._replicas), return_exceptions=True)
        self._affinity.clear()
        for replica in self._replicas:
            replica.rollouts = 0
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            raise errors[0]

    def _ensure_open(self) -> None:
        if self._closed:
            raise EngineUnavailable("the engine fleet is closed")
        if not self._started:
            raise EngineUnavailable("the engine fleet has not been started")

    # -- routing ----------------------------------------------------------------------------

    def release(self, affinity: str) -> None:
        """Forget ``affinity`` (its rollout ended): it no longer counts on its replica."""
        index = self._affinity.pop(affinity, None)
        if index is not None:
            self._replicas[index].rollouts -= 1

    def _assign(self, affinity: str, replica: _Replica) -> None:
        self.release(affinity)
        self._affinity[affinity] = replica.index
        replica.rollouts += 1
        while len(self._affinity) > self._max_affinities:
            _, index = self._affinity.popitem(last=False)
            self._replicas[index].rollouts -= 1

    def _route(self, affinity: str | None) -> _Replica:
        """The replica for a call: its rollout's while that one is live, else the least loaded
        live one (which the rollout is then assigned to)."""
        now = time.monotonic()
        states = {r.index: self._state(r, now) for r in self._replicas}
        candidates = [r for r in self._replicas if states[r.index] == "live"] or [
            r for r in self._replicas if states[r.index] == "cooling down"
        ]
        if not candidates:
            if all(state == "asleep" for state in states.values()):
                raise EngineUnavailable("the engine fleet is asleep (the machine is training); retry shortly")
            reasons = "; ".join(f"replica {i}: {state}" for i, state in states.items())
            raise EngineUnavailable(f"no engine replica can serve now ({reasons}); retry shortly")
        pinned = self._affinity.get(affinity) if affinity is not None else None
        if affinity is not None and pinned is not None and self._replicas[pinned] in candidates:
            self._affinity.move_to_end(affinity)
            return self._replicas[pinned]
        chosen = min(candidates, key=lambda r: (r.inflight, r.rollouts, r.index))
        if affinity is not None:
            if pinned is not None:
                log.info(
                    "engine fleet: rollout %s moves from replica %d (%s) to %d",
                    affinity,
                    pinned,
                    states[pinned],
                    chosen.index,
                )
            self._assign(affinity, chosen)
        return chosen

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._ensure_open()
        replica = self._route(request.affinity)
        started = time.monotonic()
        replica.inflight += 1
        try:
            result = await replica.engine.generate(request)
        except EngineUnavailable:
            if not self._closed:
                # Down, restarting, or broken: no new rollouts for a while, and this one moves.
                replica.failed_at = time.monotonic()
                if request.affinity is not None and self._affinity.get(request.affinity) == replica.index:
                    self.release(request.affinity)
            raise
        finally:
            replica.inflight -= 1
        if replica.failed_at is not None and replica.failed_at < started:
            replica.failed_at = None  # it served a call that came after its failure
        return result

    # -- weights, sleep, wake: every replica ---------------------------------------------------

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Every replica loads ``state_dict`` (at once); serve ``version`` from now on. Runs in
        its own task: if the caller is cancelled, it still completes."""
        self._ensure_open()

        async def load() -> None:
            results = await asyncio.gather(
                *(r.engine.load_weights(state_dict, version) for r in self._replicas), return_exceptions=True
            )
            self._settle("load_weights", results, version)

        await asyncio.shield(asyncio.ensure_future(load()))

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        """Every replica loads the stream (see the module docstring: one reader, a stream per
        replica, the next bucket read once every replica is done with this one); serve
        ``version`` from now on. The stream is closed when the push ends; the push runs in its
        own task and completes if the caller is cancelled."""
        try:
            self._ensure_open()
        except BaseException:
            await close_stream(buckets)
            raise
        await asyncio.shield(asyncio.ensure_future(self._push_buckets(buckets, version)))

    async def _push_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        changed = asyncio.Event()
        feeds = [_Feed(changed) for _ in self._replicas]
        streams = [feed.stream() for feed in feeds]
        loads = [
            asyncio.ensure_future(r.engine.load_weight_buckets(stream, version))
            for r, stream in zip(self._replicas, streams, strict=True)
        ]
        for load in loads:
            load.add_done_callback(lambda _: changed.set())
        source = aiter(buckets)
        source_error: Exception | None = None
        ended = False  # the last bucket (or the end of the stream) was offered
        try:
            while any(not load.done() for load in loads):
                try:
                    bucket: WeightBucket | None = await anext(source)
                except StopAsyncIteration:
                    bucket = None
                except Exception as exc:
                    source_error = exc
                    break
                for feed, load in zip(feeds, loads, strict=True):
                    if not load.done():
                        feed.offer(bucket)
                # The next bucket overwrites this one: wait until no replica still reads it.
                while True:
                    changed.clear()
                    if all(feed.done or load.done() for feed, load in zip(feeds, loads, strict=True)):
                        break
                    await changed.wait()
                if bucket is None or bucket.last:
                    ended = True
                    break
        finally:
            # A replica that asks for more gets the end of the stream after the last bucket, and
            # an error when the push stopped short (the source failed, or this task was
            # cancelled); then every load ends and every stream is closed.
            for feed, load in zip(feeds, loads, strict=True):
                if not load.done():
                    reason = source_error if source_error is not None else "cancelled"
                    stopped = EngineUnavailable(f"the fleet's weight push stopped ({reason})")
                    feed.offer(None if ended else stopped)
            await asyncio.wait(loads)
            for stream in streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()
            await close_stream(buckets)
        results: list[object] = [
            load.exception() if not load.cancelled() else asyncio.CancelledError() for load in loads
        ]
        if source_error is not None:
            raise source_error
        self._settle("load_weight_buckets", results, version)

    @property
    def in_weight_group(self) -> bool:
        """Every replica's workers are in the weight group (``WeightGroupMember``)."""
        return all(
            isinstance(r.engine, WeightGroupMember) and r.engine.in_weight_group for r in self._replicas
        )

    @property
    def weight_group_members(self) -> int:
        return sum(
            r.engine.weight_group_members for r in self._replicas if isinstance(r.engine, WeightGroupMember)
        )

    async def join_weight_group(self, spec: Mapping[str, Any], rank_offset: int = 1) -> None:
        """Every replica joins the group at once, replica i's workers at the ranks after replica
        i - 1's (the group forms only when all have joined)."""
        members = [r.engine for r in self._replicas if isinstance(r.engine, WeightGroupMember)]
        if len(members) != len(self._replicas):
            raise EngineUnavailable("a replica of this fleet cannot join a weight group (only vLLM's can)")
        offsets = [rank_offset]
        for engine in members[:-1]:
            offsets.append(offsets[-1] + engine.weight_group_members)
        await asyncio.gather(*(e.join_weight_group(spec, o) for e, o in zip(members, offsets, strict=True)))

    async def sleep(self, level: int = 1) -> None:
        """Every replica sleeps (at once); see ``Engine.sleep``."""
        self._ensure_open()
        await self._fan_out("sleep", lambda engine: engine.sleep(level))

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Every replica wakes (at once); failures seen before are forgotten."""
        self._ensure_open()
        await self._fan_out("wake", lambda engine: engine.wake(tags))
        for replica in self._replicas:
            replica.failed_at = None

    async def _fan_out(self, what: str, call: Callable[[Engine], Awaitable[_T]]) -> None:
        results = await asyncio.gather(*(call(r.engine) for r in self._replicas), return_exceptions=True)
        self._settle(what, results)

    def _settle(self, what: str, results: Sequence[object], version: int | None = None) -> None:
        """After ``what`` ran on every replica (``results`` in replica order: an exception or
        not): take ``version`` if any replica did, leave out failures of replicas that are down
        (when some replica succeeded), raise the first other failure."""
        outcomes = list(zip(self._replicas, results, strict=True))
        failed = [(r, e) for r, e in outcomes if isinstance(e, BaseException)]
        succeeded = [r for r, e in outcomes if not isinstance(e, BaseException)]
        if version is not None and succeeded:
            self._version = version
            for replica in succeeded:
                replica.failed_at = None
        fatal: list[BaseException] = []
        for replica, error in failed:
            reason = down_reason(replica.engine)
            if succeeded and isinstance(error, EngineUnavailable) and reason is not None:
                log.warning("engine fleet: %s left out replica %d (down: %s)", what, replica.index, reason)
            else:
                log.warning("engine fleet: %s failed on replica %d: %r", what, replica.index, error)
                fatal.append(error)
        if fatal:
            raise fatal[0]


class _Feed:
    """One replica's stream of a push: the buckets the fleet offers, one at a time."""

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
