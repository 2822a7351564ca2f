"""The engine fleet's fan-out: weights, sleep and wake to every replica, and remote replicas
catching up.

Owns ``FleetWeights``, the part of ``EngineFleet`` (``appliance.engines.fleet``, whose docstring
states the rules) that sends weight updates to every replica (a bucketed push through
``appliance.engines.fleet_push``'s tee; a remote replica within ``remote_deadline_s``), sleep and
wake to the local ones, settles what each replica's outcome means (the fleet's version, a remote
replica behind, a local failure raised), and starts a remote replica's catch-up (the fleet's
``catch_up``) when it is behind. It is not an engine of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from appliance.engines.base import Engine, WeightGroupMember
from appliance.engines.fleet_push import ReplicaTooSlow, tee_push
from appliance.engines.fleet_replica import CatchUp, Replica, down_reason
from contracts.errors import EngineUnavailable
from trainer.buckets import WeightBucket, close_stream

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class FleetWeights:
    """``EngineFleet``'s weights, sleep, wake and catch-ups (a part of the fleet, not an engine)."""

    _replicas: list[Replica]
    _version: int
    _closed: bool
    remote_deadline_s: float
    catch_up: CatchUp | None
    on_caught_up: Callable[[str, int], None] | None
    on_failed: Callable[[str, BaseException], None] | None

    def _ensure_open(self) -> None:
        raise NotImplementedError

    def _behind(self, replica: Replica) -> bool:
        raise NotImplementedError

    # -- weights, sleep, wake: every replica ---------------------------------------------------

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Every replica loads ``state_dict`` (at once, a remote one within its deadline); serve
        ``version`` from now on. Runs in its own task: if the caller is cancelled, it still
        completes."""
        self._ensure_open()
        replicas = list(self._replicas)

        async def bounded(replica: Replica) -> None:
            load = asyncio.ensure_future(replica.engine.load_weights(state_dict, version))
            if not replica.remote:
                return await load
            try:
                await asyncio.wait_for(asyncio.shield(load), self.remote_deadline_s)
            except TimeoutError:
                raise ReplicaTooSlow(
                    f"it did not take the weight update within {self.remote_deadline_s:g} s"
                ) from None

        async def load() -> None:
            results = await asyncio.gather(*(bounded(r) for r in replicas), return_exceptions=True)
            self._settle("load_weights", replicas, results, version)

        await asyncio.shield(asyncio.ensure_future(load()))

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        """Every replica loads the stream (``fleet_push.tee_push``: one reader, a stream per
        replica, the next bucket read once every replica is done with this one, a remote one
        dropped past its deadline); serve ``version`` from now on. The stream is closed when the
        push ends; the push runs in its own task and completes if the caller is cancelled."""
        try:
            self._ensure_open()
        except BaseException:
            await close_stream(buckets)
            raise
        replicas = list(self._replicas)

        async def push() -> None:
            results = await tee_push(
                buckets,
                [lambda stream, r=r: r.engine.load_weight_buckets(stream, version) for r in replicas],  # type: ignore[misc]
                [self.remote_deadline_s if r.remote else None for r in replicas],
            )
            self._settle("load_weight_buckets", replicas, results, version)

        await asyncio.shield(asyncio.ensure_future(push()))

    def _local(self) -> list[Replica]:
        return [r for r in self._replicas if not r.remote]

    @property
    def in_weight_group(self) -> bool:
        """Every local replica's workers are in the weight group (``WeightGroupMember``)."""
        return all(
            isinstance(r.engine, WeightGroupMember) and r.engine.in_weight_group for r in self._local()
        )

    @property
    def weight_group_members(self) -> int:
        return sum(
            r.engine.weight_group_members for r in self._local() if isinstance(r.engine, WeightGroupMember)
        )

    async def join_weight_group(self, spec: Mapping[str, Any], rank_offset: int = 1) -> None:
        """Every local replica joins the group at once, replica i's workers at the ranks after
        replica i - 1's (the group forms only when all have joined)."""
        members = [r.engine for r in self._local() if isinstance(r.engine, WeightGroupMember)]
        if len(members) != len(self._local()):
            raise EngineUnavailable("a replica of this fleet cannot join a weight group (only vLLM's can)")
        offsets = [rank_offset]
        for engine in members[:-1]:
            offsets.append(offsets[-1] + engine.weight_group_members)
        await asyncio.gather(*(e.join_weight_group(spec, o) for e, o in zip(members, offsets, strict=True)))

    async def sleep(self, level: int = 1) -> None:
        """Every local replica sleeps (at once); see ``Engine.sleep``. Remote ones serve on."""
        self._ensure_open()
        await self._fan_out("sleep", lambda engine: engine.sleep(level))

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Every local replica wakes (at once); failures seen before are forgotten."""
        self._ensure_open()
        await self._fan_out("wake", lambda engine: engine.wake(tags))
        for replica in self._replicas:
            if not replica.remote:
                replica.failed_at = None

    async def _fan_out(self, what: str, call: Callable[[Engine], Awaitable[_T]]) -> None:
        local = self._local()
        results = await asyncio.gather(*(call(r.engine) for r in local), return_exceptions=True)
        self._settle(what, local, results)

    def _settle(
        self, what: str, replicas: Sequence[Replica], results: Sequence[object], version: int | None = None
    ) -> None:
        """After ``what`` ran on ``replicas`` (``results`` in their order: an exception or not):
        take ``version`` if any replica did; a remote replica that failed is behind (never
        fatal); leave out failures of local replicas that are down (when some replica
        succeeded), raise the first other failure."""
        outcomes = list(zip(replicas, results, strict=True))
        failed = [(r, e) for r, e in outcomes if isinstance(e, BaseException)]
        succeeded = [r for r, e in outcomes if not isinstance(e, BaseException)]
        if version is not None and succeeded:
            self._version = version
            for replica in succeeded:
                replica.failed_at = None
                if replica.remote and replica.engine.policy_version == version:
                    self._caught_up(replica)
        fatal: list[BaseException] = []
        for replica, error in failed:
            reason = down_reason(replica.engine)
            if replica.remote:
                log.warning(
                    "engine fleet: %s went on without replica %s (%s): %s",
                    what,
                    replica.id,
                    replica.url,
                    error,
                )
                replica.behind = True
                self._failed(replica, error)
            elif succeeded and isinstance(error, EngineUnavailable) and reason is not None:
                log.warning("engine fleet: %s left out replica %s (down: %s)", what, replica.id, reason)
            else:
                log.warning("engine fleet: %s failed on replica %s: %r", what, replica.id, error)
                fatal.append(error)
        if fatal:
            raise fatal[0]
        if version is not None:
            self.catch_up_behind()

    # -- catching up ---------------------------------------------------------------------

    def catch_up_behind(self) -> None:
        """Start a catch-up for every remote replica that is behind and has none under way."""
        for replica in self._replicas:
            if replica.remote and self._behind(replica):
                self._start_catch_up(replica)

    def _start_catch_up(self, replica: Replica) -> None:
        if self.catch_up is None or self._closed:
            return
        if replica.catching_up is not None and not replica.catching_up.done():
            return
        replica.catching_up = asyncio.create_task(self._catch_up(replica, self.catch_up), name="catch-up")

    async def _catch_up(self, replica: Replica, catch_up: CatchUp) -> None:
        version = self._version
        try:
            await asyncio.wait_for(catch_up(replica.engine, version), self.remote_deadline_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = (
                ReplicaTooSlow(f"its catch-up took over {self.remote_deadline_s:g} s")
                if isinstance(exc, TimeoutError)
                else exc
            )
            log.warning(
                "engine fleet: replica %s could not catch up to version %d: %s", replica.id, version, error
            )
            self._failed(replica, error)
            return
        if replica.engine.policy_version == self._version:
            self._caught_up(replica)
        elif self._version != version:  # a newer version came meanwhile: take that one too
            replica.catching_up = None
            self._start_catch_up(replica)
        else:  # nothing to catch up from (the version was never published): the next push
            log.info("engine fleet: replica %s waits for a push of version %d", replica.id, version)
            replica.wants_push = True

    def _caught_up(self, replica: Replica) -> None:
        was_behind, replica.behind, replica.failed_at = replica.behind, False, None
        replica.wants_push = False
        if was_behind and replica in self._replicas and self.on_caught_up is not None:
            self.on_caught_up(replica.id, replica.engine.policy_version)

    def _failed(self, replica: Replica, error: BaseException) -> None:
        replica.failed_at = time.monotonic()
        if replica.remote and replica in self._replicas and self.on_failed is not None:
            self.on_failed(replica.id, error)
