"""One replica as the engine fleet keeps it: its engine, where it runs, its load and its standing.

Owns the replica's record (``Replica``: id, local or remote, calls and rollouts on it, its last
failure, whether it is behind), what the fleet reports of it (``ReplicaStatus``) and how a
replica says it is down (``Supervised``). Routing and fan-out over replicas are
``appliance.engines.fleet``'s and ``appliance.engines.fleet_weights``'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from appliance.engines.base import Engine

#: A remote replica's catch-up: given its engine and the fleet's version, load that version.
CatchUp = Callable[[Engine, int], Awaitable[None]]


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

    #: Its place in the fleet now (``replica_of`` answers with it).
    index: int
    #: "live", "cooling down", "behind", "stale", "needs weights", "asleep", or why it is down.
    state: str
    policy_version: int
    inflight: int
    rollouts: int
    #: Its id ("0", "1", ... for the local replicas) and, for a remote one, its URL.
    id: str = ""
    url: str = ""
    remote: bool = False


@dataclass(slots=True, eq=False)
class Replica:
    id: str
    engine: Engine
    remote: bool = False
    url: str = ""
    #: Requests the fleet has sent it that have not returned.
    inflight: int = 0
    #: Rollouts (affinities) assigned to it.
    rollouts: int = 0
    #: ``time.monotonic()`` of its last call or update that failed with ``EngineUnavailable``.
    failed_at: float | None = None
    #: It missed or failed a weight update (or just joined): its version is not trusted until
    #: it catches up.
    behind: bool = False
    #: Its catch-up under way, if any.
    catching_up: asyncio.Task[None] | None = None
    #: Its catch-up found nothing to take it to the fleet's version (nothing published at it):
    #: it waits for the scheduler's next push to all (``needs_weights``).
    wants_push: bool = False
    #: Resolved with why, to end a remote replica's calls in flight (``EngineFleet.end_calls``);
    #: made by its first call, and anew once resolved.
    ended: asyncio.Future[str] | None = None


def down_reason(engine: Engine) -> str | None:
    return engine.down_reason if isinstance(engine, Supervised) else None
