"""The engine fleet: one ``Engine`` over replica engines, so the appliance serves from several.

Owns routing, failover, the fleet's membership and the fan-out, and nothing else. Routing: every
call of a rollout goes to the replica its first call went to (``GenerateRequest.affinity``, the
rollout id: that replica's prefix cache holds the rollout's earlier turns), a new rollout to the
least loaded live replica (fewest requests in flight, then fewest rollouts assigned), a call
without a key to the least loaded. Failover: a replica that cannot serve gets no new rollouts,
and a rollout whose replica failed moves; a call that fails before its replica handed over any
token is tried once more on another replica, one that fails after is ended naming the replica
(a remote one: ``ReplicaLost``, which fails the call's rollout).
Membership: replicas the appliance launched (``local``, numbered "0", "1", ...) come with the
fleet; remote ones (vLLM servers on other machines, ``appliance.engines.remote``) are added and
removed at run time (``add``, ``remove``). Fan-out: weights, sleep and wake go to every replica at
once, a bucketed push through a tee (``appliance.engines.fleet_push``). The replicas themselves,
their processes and restarts, where they run (``appliance.engines.factory``), how a remote one
is checked, caught up and found lost (``appliance.engines.remote``), and when rollouts end (the
controller calls ``release`` through the rollout registry) are not the fleet's.

A replica is *live* when it is up (no ``down_reason``: not closed, not restarting, not given
up), awake, does not need weights, is not behind, serves a version at most ``max_staleness``
versions older than the fleet's, and has not failed a call in the last ``failure_cooldown_s``.
Only live replicas get new rollouts (when none is live, those only cooling down still do); a
rollout pinned to a replica that is no longer live moves at its next call (a cold prefix cache
there: only slower).

Remote replicas are split placement: they never sleep or wake (sleep and wake skip them) and
serve beside the local ones. Each weight update reaches a remote replica within
``remote_deadline_s`` or goes on without it; a remote replica that failed or missed an update
is *behind*: it gets no new rollouts until it catches up (``catch_up``, given by whoever adds
remote replicas, called with the fleet's version; without one, ``needs_weights`` asks the
scheduler to push the published version to all), and a failure of a remote replica never
fails the update. Local replicas keep the rule of one machine: every replica gets every push,
a failure of one that is up is raised once every replica has finished, one that is down is
left out; afterwards the fleet serves ``version`` if any replica took it, and a local replica
that did not gets no calls while ``needs_weights`` asks for a push to all.

Invariant: every token's recorded version is the one that sampled it (``GenerateResult``'s,
from the replica that served it), at most ``max_staleness`` behind the fleet's
``policy_version`` (0: every replica that gets calls serves the fleet's version). Not
thread-safe: the event loop's only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from appliance.engines.base import Engine, GenerateRequest, GenerateResult
from appliance.engines.fleet_calls import bounded
from appliance.engines.fleet_replica import CatchUp, Replica, ReplicaStatus, Supervised, down_reason
from appliance.engines.fleet_weights import FleetWeights
from contracts.errors import EngineUnavailable, ReplicaLost

log = logging.getLogger(__name__)

__all__ = ["MAX_AFFINITIES", "EngineFleet", "ReplicaStatus", "Supervised", "down_reason"]

#: Affinities kept at most (least recently used first out); ``release`` normally forgets them
#: when their rollout ends, the bound only guards against keys nobody releases.
MAX_AFFINITIES = 65536


class EngineFleet(FleetWeights):
    """An ``Engine`` over ``replicas`` (started, closed, pushed and put to sleep together), to
    which remote replicas may be added.

    The replicas must serve the same model at the same ``policy_version``. ``failure_cooldown_s``
    is how long a replica whose call failed gets no new rollouts; ``max_affinities`` bounds the
    rollouts remembered (least recently used out); ``max_staleness`` is how many versions behind
    the fleet's a replica may serve and still get rollouts (the run's staleness bound);
    ``remote_deadline_s`` bounds a remote replica's part of a weight update or a catch-up, and
    ``remote_stall_s`` the wait for each token of a call on it (``appliance.engines.fleet_calls``);
    ``catch_up`` brings a remote replica that is behind to the fleet's version; ``on_caught_up``
    (its id and version) and ``on_failed`` (its id and the error) tell whoever added it.
    """

    def __init__(
        self,
        replicas: Sequence[Engine],
        *,
        failure_cooldown_s: float = 5.0,
        max_affinities: int = MAX_AFFINITIES,
        max_staleness: int = 0,
        remote_deadline_s: float = 60.0,
        remote_stall_s: float = 30.0,
    ) -> None:
        if not replicas:
            raise ValueError("an engine fleet needs at least one replica")
        versions = {engine.policy_version for engine in replicas}
        if len(versions) != 1:
            raise ValueError(f"the replicas serve different policy versions {sorted(versions)}")
        if max_affinities < 1:
            raise ValueError(f"max_affinities must be at least 1, got {max_affinities}")
        self._replicas = [Replica(str(i), engine) for i, engine in enumerate(replicas)]
        self._version = versions.pop()
        self._cooldown_s = failure_cooldown_s
        self._max_affinities = max_affinities
        self.max_staleness = max_staleness
        self.remote_deadline_s = remote_deadline_s
        self.remote_stall_s = remote_stall_s
        self.catch_up: CatchUp | None = None
        self.on_caught_up: Callable[[str, int], None] | None = None
        self.on_failed: Callable[[str, BaseException], None] | None = None
        #: Affinity key -> its replica, least recently used first.
        self._affinity: OrderedDict[str, Replica] = OrderedDict()
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
        """A local replica is up but lacks the fleet's weights (it lost a bucketed version, or
        missed a push while it was down or failed), or a remote one that is up is behind, has
        not failed lately and no catch-up can bring it to the fleet's version (none is given, or
        its catch-up found nothing published at it): the scheduler then pushes to all."""
        if self._closed:
            return False
        now = time.monotonic()
        return any(self._lacks_weights(replica, now) for replica in self._replicas)

    def _lacks_weights(self, replica: Replica, now: float) -> bool:
        engine = replica.engine
        if not replica.remote:
            return engine.needs_weights or (
                down_reason(engine) is None
                and not engine.is_sleeping
                and engine.policy_version != self._version
            )
        recent = replica.failed_at is not None and now - replica.failed_at < self._cooldown_s
        pushed = self.catch_up is None or replica.wants_push  # no catch-up can bring it there
        return pushed and down_reason(engine) is None and not recent and self._behind(replica)

    def _behind(self, replica: Replica) -> bool:
        lag = self._version - replica.engine.policy_version
        return replica.behind or replica.engine.needs_weights or not 0 <= lag <= self.max_staleness

    @property
    def is_sleeping(self) -> bool:
        """Whether the local replicas that are up sleep (all of them, when none is up)."""
        local = [r for r in self._replicas if not r.remote]
        up = [r for r in local if down_reason(r.engine) is None] or local
        return any(replica.engine.is_sleeping for replica in up)

    def replica_of(self, affinity: str) -> int | None:
        """The index of the replica ``affinity``'s calls go to, if it has one."""
        replica = self._affinity.get(affinity)
        return None if replica is None else self._replicas.index(replica)

    def status(self) -> tuple[ReplicaStatus, ...]:
        now = time.monotonic()
        return tuple(
            ReplicaStatus(
                index=i,
                state=self._state(r, now),
                policy_version=r.engine.policy_version,
                inflight=r.inflight,
                rollouts=r.rollouts,
                id=r.id,
                url=r.url,
                remote=r.remote,
            )
            for i, r in enumerate(self._replicas)
        )

    def _state(self, replica: Replica, now: float) -> str:
        engine = replica.engine
        if (reason := down_reason(engine)) is not None:
            return reason
        if engine.is_sleeping and not replica.remote:
            return "asleep"
        if engine.needs_weights:
            return "needs weights"
        if replica.behind:
            return "behind"
        if not 0 <= self._version - engine.policy_version <= self.max_staleness:
            return "stale"
        if replica.failed_at is not None and now - replica.failed_at < self._cooldown_s:
            return "cooling down"
        return "live"

    # -- lifecycle and membership ---------------------------------------------------------------

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
        for replica in self._replicas:
            if replica.catching_up is not None:
                replica.catching_up.cancel()
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

    def add(self, engine: Engine, *, replica_id: str, url: str) -> None:
        """Add a started remote replica ``engine`` as ``replica_id``; it is behind (no rollouts)
        until it catches up to the fleet's version."""
        self._ensure_open()
        if any(r.id == replica_id for r in self._replicas):
            raise ValueError(f"the fleet has a replica {replica_id!r} already")
        replica = Replica(replica_id, engine, remote=True, url=url, behind=True)
        self._replicas.append(replica)
        log.info("engine fleet: replica %s (%s) joined", replica_id, url)
        self._start_catch_up(replica)

    def remove(self, replica_id: str) -> Engine:
        """Take the remote replica ``replica_id`` out of the fleet (its rollouts move at their
        next call; its calls under way end as they end); returns its engine, for the caller to
        close."""
        replica = self._find(replica_id)
        if not replica.remote:
            raise ValueError(f"replica {replica_id} was launched by the appliance; only remote ones leave")
        self._replicas.remove(replica)
        if replica.catching_up is not None:
            replica.catching_up.cancel()
        for affinity in [a for a, r in self._affinity.items() if r is replica]:
            del self._affinity[affinity]
        log.info("engine fleet: replica %s (%s) left", replica_id, replica.url)
        return replica.engine

    def _find(self, replica_id: str) -> Replica:
        for replica in self._replicas:
            if replica.id == replica_id:
                return replica
        raise KeyError(replica_id)

    def engine_of(self, replica_id: str) -> Engine:
        """The engine of replica ``replica_id`` (``KeyError`` if the fleet has none such)."""
        return self._find(replica_id).engine

    # -- routing ----------------------------------------------------------------------------

    def release(self, affinity: str) -> None:
        """Forget ``affinity`` (its rollout ended): it no longer counts on its replica."""
        replica = self._affinity.pop(affinity, None)
        if replica is not None:
            replica.rollouts -= 1

    def _assign(self, affinity: str, replica: Replica) -> None:
        self.release(affinity)
        self._affinity[affinity] = replica
        replica.rollouts += 1
        while len(self._affinity) > self._max_affinities:
            _, oldest = self._affinity.popitem(last=False)
            oldest.rollouts -= 1

    def _route(self, affinity: str | None, tried: Sequence[Replica] = ()) -> Replica:
        """The replica for a call: its rollout's while that one is live, else the least loaded
        live one (which the rollout is then assigned to); never one of ``tried``."""
        now = time.monotonic()
        states = {id(r): self._state(r, now) for r in self._replicas}
        open_ = [r for r in self._replicas if r not in tried]
        candidates = [r for r in open_ if states[id(r)] == "live"] or [
            r for r in open_ if states[id(r)] == "cooling down"
        ]
        if not candidates:
            if all(state == "asleep" for state in states.values()):
                raise EngineUnavailable("the engine fleet is asleep (the machine is training); retry shortly")
            reasons = "; ".join(f"replica {r.id}: {states[id(r)]}" for r in self._replicas)
            raise EngineUnavailable(f"no engine replica can serve now ({reasons}); retry shortly")
        pinned = self._affinity.get(affinity) if affinity is not None else None
        if affinity is not None and pinned is not None and pinned in candidates:
            self._affinity.move_to_end(affinity)
            return pinned
        chosen = min(candidates, key=lambda r: (r.inflight, r.rollouts, self._replicas.index(r)))
        if affinity is not None:
            if pinned is not None:
                state = states.get(id(pinned), "removed")
                log.info(
                    "engine fleet: rollout %s moves from replica %s (%s) to %s",
                    affinity,
                    pinned.id,
                    state,
                    chosen.id,
                )
            self._assign(affinity, chosen)
        return chosen

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate on the rollout's replica; if it fails before it handed over a token, once
        more on another replica. A remote one that fails after handing tokens over ends the call
        with a ``ReplicaLost`` naming the replica (its rollout then fails), a local one with an
        ``EngineUnavailable`` naming it (its supervisor restarts it; the call may be retried)."""
        self._ensure_open()
        tried: list[Replica] = []
        while True:
            replica = self._route(request.affinity, tried)
            handed = _Handed(request)
            try:
                return await self._generate_on(replica, handed)
            except EngineUnavailable as exc:
                if self._closed:
                    raise
                if handed.tokens and replica.remote:
                    raise ReplicaLost(
                        f"engine replica {replica.id} ({replica.url}) was lost mid-call, after it "
                        f"sampled {handed.tokens} tokens of this call: {exc}"
                    ) from exc
                if handed.tokens:  # a local one: restarted by its supervisor, the call may be retried
                    raise EngineUnavailable(
                        f"engine replica {replica.id} failed after it sampled {handed.tokens} tokens "
                        f"of this call: {exc}"
                    ) from exc
                tried.append(replica)
                if len(self._replicas) <= len(tried) or len(tried) > 1:
                    raise
                log.info(
                    "engine fleet: a call failed on replica %s before any token (%s); trying another",
                    replica.id,
                    exc,
                )

    def end_calls(self, replica_id: str, reason: str) -> None:
        """End the calls in flight on remote replica ``replica_id`` with ``reason`` (its health
        probe failed, it was lost): each is served elsewhere, or ended with ``ReplicaLost`` if
        it had tokens. None such: nothing to end."""
        replica = next((r for r in self._replicas if r.id == replica_id), None)
        if replica is not None and replica.ended is not None:
            replica.ended.set_result(reason)
            replica.ended = None

    async def _generate_on(self, replica: Replica, handed: _Handed) -> GenerateResult:
        started = time.monotonic()
        request = handed.request
        replica.inflight += 1
        try:
            if replica.remote:
                if replica.ended is None:
                    replica.ended = asyncio.get_running_loop().create_future()
                generation = replica.engine.generate(request)
                result = await bounded(
                    generation, stall_s=self.remote_stall_s, progress=handed.last, ended=replica.ended
                )
            else:
                result = await replica.engine.generate(request)
        except EngineUnavailable as exc:
            if not self._closed:
                # Down, restarting, or broken: no new rollouts for a while, and this one moves.
                if request.affinity is not None and self._affinity.get(request.affinity) is replica:
                    self.release(request.affinity)
                self._failed(replica, exc)
            raise
        finally:
            replica.inflight -= 1
        if replica.failed_at is not None and replica.failed_at < started:
            replica.failed_at = None  # it served a call that came after its failure
        return result


class _Handed:
    """A request whose token callbacks count what the engine handed over (``tokens``: a call
    that failed before any can be tried again elsewhere) and when it last did (``last_at``)."""

    def __init__(self, request: GenerateRequest) -> None:
        self.tokens = 0
        self.last_at = time.monotonic()
        on_token, on_tokens = request.on_token, request.on_tokens
        changes: dict[str, Any] = {}
        if on_token is not None:

            def one(token: int, logprob: float) -> None:
                self.tokens += 1
                self.last_at = time.monotonic()
                on_token(token, logprob)

            changes["on_token"] = one
        if on_tokens is not None:

            def several(tokens: Sequence[int], logprobs: Sequence[float]) -> None:
                self.tokens += len(tokens)
                self.last_at = time.monotonic()
                on_tokens(tokens, logprobs)

            changes["on_tokens"] = several
        self.request = dataclasses.replace(request, **changes) if changes else request

    def last(self) -> float:
        """The ``time.monotonic()`` of the last token handed over (of the start, before one)."""
        return self.last_at
