"""External runners: rollouts offered to harnesses the appliance did not start, and their leases.

Owns the board between the rollout controller and runners elsewhere (another machine, a
cluster's job system, a notebook). With the ``external`` adapter nothing is started here: the
adapter's ``run`` is ``RunnerBoard.run``, which offers the rollout and waits until its runner
finishes it, fails it, or goes silent. The proxy's routes (``appliance.proxy.runners``) claim
offers, take heartbeats and finishes. The board also owns the tasks runners bring: a task queued
by a claim goes ahead of the task set, so the next group the scheduler starts is on it.

It decides nothing about scheduling: the scheduler still decides when groups start (the
staleness bound, batch composition, pauses); a claim only takes what was offered, waiting at
most ``runner_claim_wait_s`` for it. What it keeps true:

* an offer is claimed at most once, oldest first; a claim whose client went away before its
  answer puts the offer back at the front;
* a claim that times out leaves nothing behind: its waiter is withdrawn, and a task it queued is
  withdrawn too unless a group already started on it (whose rollouts stay claimable); its 503
  names what holds new groups back (an operator's pause, the circuit breaker, a training step,
  a batch full of groups) with a Retry-After to match;
* a task a runner brings goes ahead of training groups nobody has claimed: when no group starts
  on it within ``MAKE_ROOM_AFTER_S`` and the scheduler is not paused, an offered group none of
  whose rollouts was claimed is withdrawn (its rollouts fail as ``withdrawn:``, which the
  circuit breaker does not count; no runner saw them) and its task is drawn again right after
  the runner's, so a batch full of unclaimed offers never keeps a runner's task waiting;
* a claimed rollout whose runner shows no sign of life (an authorised request on the rollout's
  routes: a model call, a reward, a heartbeat; a model call in flight counts throughout, see
  ``ActiveRollout.last_seen`` / ``busy``) for ``runner_lease_s`` is failed with a reason saying
  so, so the scheduler never waits on a vanished runner. Unclaimed offers wait for a runner
  until the controller's ``rollout_timeout_s`` or the stop cancels them, like any rollout.

The event log is untouched here: the controller records ``RolloutCreated`` before an offer
and ``RolloutFinished`` when ``run`` returns or raises (``AgentFailed`` with the reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from appliance.rollouts.registry import RolloutRegistry
from contracts.errors import Conflict, NothingToClaim
from harness_adapters.base import AgentFailed, ClientConfig, HarnessAdapter, Task
from harness_adapters.external import ExternalAdapter

if TYPE_CHECKING:
    from appliance.config import HarnessConfig
    from appliance.scheduler.live import LiveState

log = logging.getLogger(__name__)

#: Task id fields a runner's task may carry (as task sets name them); else one is derived.
ID_FIELDS = ("id", "instance_id", "task_id")
#: Ended rollouts remembered, so finishing one twice is a 409 rather than a 404.
REMEMBERED = 4096
#: Seconds a finish waits for its ``RolloutFinished`` to be folded into the live state.
RECORD_WAIT_S = 30.0
#: Seconds a claim with a task waits for a group to start on it before it withdraws an offered
#: group nobody claimed, to make room (at most half of ``runner_claim_wait_s``).
MAKE_ROOM_AFTER_S = 1.0
#: How the reason of a rollout withdrawn unclaimed begins (``AgentFailed: withdrawn: ...`` in its
#: ``RolloutFinished``; ``store.projections.NOT_THE_HARNESS`` knows it).
WITHDRAWN = "withdrawn:"


@dataclass(eq=False, slots=True)
class Offer:
    """One rollout waiting for, or held by, an external runner."""

    task: Task
    client: ClientConfig
    #: How the rollout ended: (status, reason), set once.
    ended: asyncio.Future[tuple[str, str]]
    #: ``time.monotonic()`` when a runner claimed it (None: not claimed yet).
    claimed_at: float | None = None
    #: Set when something the lease watch must look at changed (a claim).
    poke: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False, slots=True)
class Reservation:
    """A claim for a task it brought: the first rollout offered of that task is its."""

    task: Task
    claim: asyncio.Future[Offer]
    #: Whether the controller has drawn the task for a group.
    drawn: bool = False


def task_from(data: dict[str, Any]) -> Task:
    """A runner's task: its own id (``id``, ``instance_id`` or ``task_id``), else one derived
    from its content."""
    for name in ID_FIELDS:
        value = data.get(name)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return Task(id=str(value), data=data)
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    return Task(id=f"external-{digest[:12]}", data=data)


class RunnerBoard:
    def __init__(
        self,
        registry: RolloutRegistry,
        *,
        lease_s: float,
        claim_wait_s: float,
        live: Callable[[], LiveState] | None = None,
    ) -> None:
        """``registry``: the proxy's live rollouts (their signs of life); ``live``: the live
        projection, for a finish to wait until its rollout's end is recorded."""
        self._registry = registry
        self.lease_s = lease_s
        self.claim_wait_s = claim_wait_s
        self._live = live
        #: Unclaimed offers, oldest first; every offer not ended, by rollout id.
        self._pool: deque[Offer] = deque()
        self._offers: dict[str, Offer] = {}
        #: ``{}`` claims waiting for an offer, oldest first.
        self._waiters: deque[asyncio.Future[Offer]] = deque()
        #: Tasks claims brought, not yet drawn; drawn ones waiting for their first offer.
        self._queued: deque[Reservation] = deque()
        self._drawn: list[Reservation] = []
        #: Tasks of groups withdrawn unclaimed, drawn again right after the claims' tasks.
        self._returned: deque[Task] = deque()
        #: Ended rollouts: id -> (its key, status), the newest ``REMEMBERED``.
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()

    @property
    def offered(self) -> int:
        """Rollouts offered and not claimed yet."""
        return len(self._pool)

    @property
    def queued(self) -> int:
        """Tasks claims brought that no group has started on yet."""
        return len(self._queued)

    # --- the controller's side -------------------------------------------------------------------

    def tasks(self, stream: Iterator[Task]) -> Iterator[Task]:
        """``stream`` with the tasks claims brought ahead of it (the controller draws from this)."""
        while True:
            if self._queued:
                reservation = self._queued.popleft()
                reservation.drawn = True
                self._drawn.append(reservation)
                yield reservation.task
                continue
            if self._returned:
                yield self._returned.popleft()
                continue
            try:
                task = next(stream)
            except StopIteration:
                return
            yield task

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        """Offer the rollout and wait until it ends: None when its runner finished it (its reward
        came over HTTP); ``AgentFailed`` with the reason when the runner failed it or its lease
        ran out. Cancelling (the rollout's timeout, the stop) withdraws the offer."""
        offer = Offer(task=task, client=client, ended=asyncio.get_running_loop().create_future())
        rollout = client.rollout_id
        self._offers[rollout] = offer
        self._hand_out(offer)
        try:
            status, reason = await self._until_end(offer)
        finally:
            self._offers.pop(rollout, None)
            with contextlib.suppress(ValueError):
                self._pool.remove(offer)
            done = offer.ended.done() and not offer.ended.cancelled()
            self._remember(rollout, client.api_key, offer.ended.result()[0] if done else "failed")
        if status == "failed":
            raise AgentFailed(reason)
        return None

    def _hand_out(self, offer: Offer) -> None:
        """To the claim that brought its task, else the oldest waiting claim, else the pool."""
        for reservation in self._drawn:
            if reservation.task is offer.task:
                self._drawn.remove(reservation)
                if not reservation.claim.done():
                    self._claimed(offer)
                    reservation.claim.set_result(offer)
                    return
                break
        if not self._to_waiter(offer):
            self._pool.append(offer)

    def _claimed(self, offer: Offer) -> None:
        offer.claimed_at = time.monotonic()
        offer.poke.set()

    async def _until_end(self, offer: Offer) -> tuple[str, str]:
        """Wait for the rollout's end, failing it once its claimed runner is silent too long."""
        while not offer.ended.done():
            timeout = None
            if offer.claimed_at is not None:
                idle = self._idle_s(offer)
                if idle >= self.lease_s:
                    reason = (
                        f"its external runner showed no sign of life for {self.lease_s:g} s (no model "
                        "call, reward or heartbeat; runner_lease_s): it is taken to be gone"
                    )
                    offer.ended.set_result(("failed", reason))
                    log.warning("rollout %s: %s", offer.client.rollout_id, reason)
                    break
                timeout = self.lease_s - idle
            offer.poke.clear()
            poked = asyncio.ensure_future(offer.poke.wait())
            try:
                await asyncio.wait((offer.ended, poked), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                poked.cancel()
        return offer.ended.result()

    def _idle_s(self, offer: Offer) -> float:
        """Seconds since the claimed rollout's last sign of life (0 while a call is in flight)."""
        assert offer.claimed_at is not None
        active = self._registry.get(offer.client.rollout_id)
        if active is not None and active.busy:
            return 0.0
        seen = max(offer.claimed_at, active.last_seen) if active is not None else offer.claimed_at
        return time.monotonic() - seen

    def _remember(self, rollout: str, key: str, status: str) -> None:
        self._ended[rollout] = (key, status)
        while len(self._ended) > REMEMBERED:
            self._ended.popitem(last=False)

    # --- the runners' side (the proxy's routes) ---------------------------------------------------

    async def claim(self, task: Task | None = None) -> Offer:
        """The oldest offered rollout, or (with ``task``) one of a group on that task, queued
        ahead of the task set; waits at most ``claim_wait_s``, then ``NothingToClaim``."""
        loop = asyncio.get_running_loop()
        claim: asyncio.Future[Offer] = loop.create_future()
        reservation = None
        if task is not None:
            reservation = Reservation(task=task, claim=claim)
            self._queued.append(reservation)
        elif self._pool:
            offer = self._pool.popleft()
            self._claimed(offer)
            return offer
        else:
            self._waiters.append(claim)
        try:
            if reservation is None:
                await asyncio.wait_for(asyncio.shield(claim), self.claim_wait_s)
            else:
                await self._wait_making_room(claim, reservation)
        except TimeoutError:
            pass
        except asyncio.CancelledError:  # the client went away: what it was handed goes back
            if claim.done() and not claim.cancelled():
                self.release(claim.result())
            claim.cancel()
            self._withdraw(claim, reservation)
            raise
        if claim.done():
            return claim.result()
        claim.cancel()
        started = self._withdraw(claim, reservation)
        cause, retry_after_s = self._holding_back()
        raise NothingToClaim(
            self._nothing_message(reservation, started=started, cause=cause), retry_after_s=retry_after_s
        )

    async def _wait_making_room(self, claim: asyncio.Future[Offer], reservation: Reservation) -> None:
        """Wait ``claim_wait_s`` for the claim's rollout; if no group has started on its task
        after ``MAKE_ROOM_AFTER_S``, withdraw an offered group nobody claimed to make room."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.claim_wait_s
        grace = min(MAKE_ROOM_AFTER_S, self.claim_wait_s / 2)
        try:
            await asyncio.wait_for(asyncio.shield(claim), grace)
            return
        except TimeoutError:
            pass
        if not reservation.drawn:
            self._make_room(reservation)
        await asyncio.wait_for(asyncio.shield(claim), max(0.0, deadline - loop.time()))

    def _make_room(self, reservation: Reservation) -> None:
        """Withdraw the newest training group whose rollouts are all offered and unclaimed, and
        queue its task right after the claims' tasks; nothing when the scheduler would not start
        a group anyway (paused, stopping, the breaker's back-off) or no group is unclaimed."""
        if self._live is None:
            return
        state = self._live().state
        if state.paused or state.stop_requested or state.admissions_paused_at(time.time()) is not None:
            return
        unclaimed: dict[str, list[Offer]] = {}
        for offer in self._pool:
            view = state.rollouts.get(offer.client.rollout_id)
            if (
                view is not None
                and view.purpose == "train"
                and view.status == "running"
                and not offer.ended.done()
            ):
                unclaimed.setdefault(view.group, []).append(offer)
        for group in reversed(unclaimed):
            offers = unclaimed[group]
            running = [v for v in state.rollouts.values() if v.group == group and v.status == "running"]
            if len(running) != len(offers):
                continue  # some of it was claimed: a runner is at work on the group
            task = offers[0].task
            reason = (
                f"{WITHDRAWN} nobody had claimed it when a runner brought task {reservation.task.id!r}, "
                f"which goes ahead of unclaimed groups; task {task.id!r} is drawn again after it"
            )
            for offer in offers:
                self._pool.remove(offer)
                offer.ended.set_result(("failed", reason))
            self._returned.append(task)
            log.info("group %s withdrawn unclaimed to start task %r first", group, reservation.task.id)
            return

    def _holding_back(self) -> tuple[str, int]:
        """What keeps the scheduler from starting a group now, and seconds to retry after."""
        if self._live is None:
            return "the scheduler starts groups when its batch and staleness bound allow", 5
        state = self._live().state
        now = time.time()
        if state.stop_requested:
            return "the appliance is stopping", 30
        if state.paused:
            return (
                'an operator paused the run (POST /admin/control {"action": "resume"} or the '
                "dashboard resumes it)",
                30,
            )
        trip = state.admissions_paused_at(now)
        if trip is not None:
            left = trip.ts + trip.backoff_s - now
            return (
                f"the circuit breaker paused admissions for {trip.backoff_s:g} s after {trip.failures} "
                f"training rollouts failed in a row ({left:.0f} s left; last: {trip.cause[:200]})",
                max(1, math.ceil(left)),
            )
        if state.phase == "train":
            return f"the machine is training step {state.step + 1}; new groups start after it", 10
        if self._pool:
            return (
                f"the batch is full: {len(self._pool)} offered rollouts wait to be claimed (claim "
                "them with an empty body)",
                5,
            )
        return (
            "the batch is full: its groups are running, and the next starts when the staleness "
            "bound allows (after a step)",
            5,
        )

    def _withdraw(self, claim: asyncio.Future[Offer], reservation: Reservation | None) -> bool:
        """Forget a claim that got nothing; whether a group had started on its task."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(claim)
        if reservation is None:
            return False
        if reservation in self._queued:
            self._queued.remove(reservation)
            return False
        with contextlib.suppress(ValueError):
            self._drawn.remove(reservation)
        return reservation.drawn

    def _nothing_message(self, reservation: Reservation | None, *, started: bool, cause: str) -> str:
        waited = f"within {self.claim_wait_s:g} s (runner_claim_wait_s)"
        if reservation is None:
            return f"no rollout was offered {waited}: {cause}; retry later"
        if started:
            return (
                f"a group on task {reservation.task.id!r} started but none of its rollouts was offered "
                f"{waited}; they stay claimable with an empty body"
            )
        return (
            f"no group started on task {reservation.task.id!r} {waited}: {cause}; the task was "
            "withdrawn and nothing was recorded; retry later"
        )

    def release(self, offer: Offer) -> None:
        """Put a claimed offer back at the front (its claim's answer never reached the runner)."""
        if offer.ended.done() or offer.client.rollout_id not in self._offers:
            return
        offer.claimed_at = None
        offer.poke.set()
        self._hand_back(offer)

    def _hand_back(self, offer: Offer) -> None:
        if not self._to_waiter(offer):
            self._pool.appendleft(offer)

    def _to_waiter(self, offer: Offer) -> bool:
        """Give ``offer`` to the oldest claim still waiting; False if none is."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._claimed(offer)
                waiter.set_result(offer)
                return True
        return False

    def offer_of(self, rollout: str) -> Offer | None:
        """The live offer of ``rollout`` (None: not an external runner's, or ended)."""
        return self._offers.get(rollout)

    def ended(self, rollout: str) -> tuple[str, str] | None:
        """(key, status) of a rollout that ended here, while it is remembered."""
        return self._ended.get(rollout)

    def finish(self, offer: Offer, status: str, reason: str) -> None:
        """End a claimed rollout as its runner says; ``Conflict`` when it has already ended."""
        rollout = offer.client.rollout_id
        if offer.ended.done():
            raise Conflict(f"rollout {rollout!r} has already ended ({offer.ended.result()[0]})")
        if offer.claimed_at is None:
            raise Conflict(f"rollout {rollout!r} has not been claimed", param="rollout")
        offer.ended.set_result((status, reason))

    async def recorded(self, rollout: str) -> None:
        """Return once the rollout's ``RolloutFinished`` is in the live state (bounded)."""
        if self._live is None:
            return
        live = self._live()

        async def until_ended() -> None:
            while (view := live.state.rollouts.get(rollout)) is None or view.status == "running":
                await live.wait_change(live.position)

        try:
            await asyncio.wait_for(until_ended(), RECORD_WAIT_S)
        except TimeoutError:
            log.warning("rollout %s: its end was not recorded within %g s", rollout, RECORD_WAIT_S)

    def recorded_end(self, rollout: str) -> tuple[str, str] | None:
        """How the log ended ``rollout`` (its status and reason), once
        :meth:`recorded` saw it; None when it is not recorded (yet). The appliance may fail a
        rollout its runner finished (e.g. one whose model calls were all refused)."""
        if self._live is None:
            return None
        view = self._live().state.rollouts.get(rollout)
        if view is None or view.status == "running":
            return None
        return view.status, view.error


def attach(
    adapter: HarnessAdapter, registry: RolloutRegistry, harness: HarnessConfig, live: Callable[[], LiveState]
) -> RunnerBoard | None:
    """The board of an ``external`` adapter (attached to it), or None for any other adapter."""
    if not isinstance(adapter, ExternalAdapter):
        return None
    board = RunnerBoard(
        registry, lease_s=harness.runner_lease_s, claim_wait_s=harness.runner_claim_wait_s, live=live
    )
    adapter.board = board
    return board
