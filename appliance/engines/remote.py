"""Remote replicas: vLLM servers on other machines joining the engine fleet by URL.

Owns a remote replica's life in the run: registering it (the server's model checked against the
run's by ``appliance.engines.remote_check``, ``EngineRegistered`` made durable, then the replica
added to the fleet, behind until it holds the run's policy version), its catch-up (the engine's
``pull_current``, a pull of the newest published version over HTTP, where the engines pull;
else the scheduler's push to all, through the fleet's ``needs_weights``) and ``EngineCaughtUp``,
finding it lost (a failed call or update, or a missed ``/health`` on the watch every
``watch_interval_s``: two misses in a row) and ``EngineLost``, ending its calls in flight at its
first missed ``/health`` (``EngineFleet.end_calls``; a call that stalls is the fleet's to end),
removing it (``EngineLost`` with ``removed``), and at a start re-attaching those the log holds
and ``[engine] remote`` names. The routing and fan-out are the fleet's
(``appliance.engines.fleet``), the HTTP routes ``appliance.proxy.engines_admin``.

Invariant: the fleet holds a remote replica only after its ``EngineRegistered`` is durable, and
every replica that leaves it is recorded (``EngineLost``), so a restarted appliance finds the
replicas it served with again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from appliance.config import ApplianceConfig
from appliance.config.engine import remote_url
from appliance.engines.adapter_publication import AdapterPublication, adapters_beside
from appliance.engines.base import Engine
from appliance.engines.factory import remote_engine
from appliance.engines.fleet import EngineFleet
from appliance.engines.remote_check import check_remote
from appliance.engines.vllm_pull import PullSource
from appliance.engines.weight_publication import WeightPublication
from contracts.errors import BadRequest, ConfigError, EngineUnavailable, NotFound
from store.events import EngineCaughtUp, EngineLost, EngineRegistered, Event
from store.eventstore import EventStore
from store.projections import ReplicaView

log = logging.getLogger(__name__)

#: Makes the engine of a remote replica: its URL, the name it serves the model under, and its
#: policy version as far as the appliance knows (-1: unknown).
MakeEngine = Callable[[str, str, int], Engine]
#: Seconds a ``/health`` probe waits.
HEALTH_TIMEOUT_S = 5.0


def replica_id(url: str) -> str:
    """A remote replica's id: the same for the same URL, so one registered again keeps it."""
    return "r" + hashlib.sha256(url.encode()).hexdigest()[:6]


class RemoteReplicas:
    """The remote replicas of ``fleet``, recorded in ``store``; ``make_engine`` attaches to one."""

    def __init__(
        self,
        fleet: EngineFleet,
        store: EventStore,
        *,
        model: str,
        model_dir: Path,
        make_engine: MakeEngine,
        pulls: bool = False,
        watch_interval_s: float = 5.0,
    ) -> None:
        self._fleet, self._store, self._model, self._model_dir = fleet, store, model, model_dir
        self._make_engine = make_engine
        self._watch_interval_s = watch_interval_s
        #: Every remote replica this run knows, by id: the log's view, kept current here.
        self.known: dict[str, ReplicaView] = {}
        self._misses: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._watch: asyncio.Task[None] | None = None
        #: The LoRA adapters published for the replicas that pull (None: they take pushes).
        self.adapters: AdapterPublication | None = None
        fleet.on_failed = self._on_failed
        fleet.on_caught_up = self._on_caught_up
        if pulls:
            fleet.catch_up = _pull_current

    async def start(self, recorded: Iterable[ReplicaView], configured: Sequence[str]) -> None:
        """Re-attach the replicas the log holds (registered and not removed) and register those
        ``configured`` names that it does not; one that does not answer is logged and, unless
        the log has it lost already, recorded lost. Then the watch starts."""
        self._session = aiohttp.ClientSession()
        urls = []
        for view in recorded:
            self.known[view.replica] = view
            urls.append(view.url)
        for url in urls + [u for u in map(remote_url, configured) if u not in urls]:
            try:
                await self.register(url)
            except (BadRequest, EngineUnavailable) as exc:
                log.warning("remote engine %s did not join: %s", url, exc)
                known = self.known.get(replica_id(url))
                if known is not None and known.state != "lost":
                    await self._record(EngineLost(ts=time.time(), replica=known.replica, reason=str(exc)))
                    known.state, known.reason = "lost", str(exc)
        self._watch = asyncio.create_task(self._watch_loop(), name="remote engines")

    async def close(self) -> None:
        """Stop watching (the fleet closes the replicas' engines)."""
        for task in [self._watch, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in [self._watch, *self._tasks] if t is not None), return_exceptions=True
        )
        if self._session is not None:
            await self._session.close()

    # -- registering and removing ----------------------------------------------------------------

    async def register(self, url: str) -> dict[str, Any]:
        """Check the server at ``url`` serves the run's model, record it, add it to the fleet
        (behind: it catches up before it takes rollouts); its listing entry. A server already
        in the fleet is answered as it is."""
        try:
            url = remote_url(url)
        except ConfigError as exc:
            raise BadRequest(str(exc), param="url") from None
        async with self._lock:
            rid = replica_id(url)
            if any(status.id == rid for status in self._fleet.status()):
                return self.entry(rid)
            assert self._session is not None, "start() first"
            remote = await check_remote(self._session, url, self._model_dir, self._fleet.max_context)
            # Unknown: it takes the run's version, unless the run is at its checkpoint's (0).
            known = (
                remote.policy_version
                if remote.policy_version >= 0
                else -1
                if self._fleet.policy_version
                else 0
            )
            engine = self._make_engine(url, remote.served_name, known)
            try:
                await engine.start()
            except BaseException:
                await engine.close()
                raise
            event = EngineRegistered(
                ts=time.time(),
                replica=rid,
                url=url,
                model=self._model,
                policy_version=remote.policy_version,
                max_model_len=remote.max_model_len,
                weights=transport(engine),
            )
            await self._record(event)
            self.known[rid] = ReplicaView(rid, url, self._model, remote.policy_version, weights=event.weights)
            self._misses[rid] = 0
            self._fleet.add(engine, replica_id=rid, url=url)
            log.info(
                "remote engine %s (%s) joined; it takes version %d", rid, url, self._fleet.policy_version
            )
            return self.entry(rid)

    async def remove(self, rid: str) -> dict[str, Any]:
        """Take replica ``rid`` out of the fleet for good (``EngineLost``, ``removed``)."""
        view = self.known.get(rid)
        if view is None:
            raise NotFound(f"no remote engine {rid!r}; GET /admin/engines lists them", param="id")
        await self._record(
            EngineLost(ts=time.time(), replica=rid, reason="removed by an operator", removed=True)
        )
        del self.known[rid]
        await self._leave(rid)
        return {"id": rid, "url": view.url, "removed": True}

    async def _leave(self, rid: str) -> None:
        with contextlib.suppress(KeyError):
            engine = self._fleet.remove(rid)
            await engine.close()

    async def lose(self, rid: str, reason: str) -> None:
        """Replica ``rid`` stopped answering: out of the fleet, recorded lost (re-registering it
        brings it back)."""
        view = self.known.get(rid)
        if view is None or view.state == "lost":
            return
        view.state, view.reason = "lost", reason
        log.warning("remote engine %s (%s) lost: %s", rid, view.url, reason)
        self._fleet.end_calls(rid, reason)
        await self._leave(rid)
        await self._record(EngineLost(ts=time.time(), replica=rid, reason=reason))

    # -- what the fleet and the watch say ---------------------------------------------------------

    def entry(self, rid: str) -> dict[str, Any]:
        """Replica ``rid`` as ``GET /admin/engines`` lists it."""
        for status in self._fleet.status():
            if status.id == rid:
                return {
                    "id": status.id,
                    "url": status.url,
                    "remote": status.remote,
                    "state": status.state,
                    "policy_version": status.policy_version,
                    "inflight": status.inflight,
                    "rollouts": status.rollouts,
                    "weights": transport(self._fleet.engine_of(rid)) if status.remote else "local",
                }
        view = self.known[rid]
        state = "lost" if view.state == "lost" else "not attached"
        return {"id": rid, "url": view.url, "remote": True, "state": state, "reason": view.reason}

    def listing(self) -> list[dict[str, Any]]:
        """Every replica of the fleet, then the remote ones it lost."""
        ids = [status.id for status in self._fleet.status()]
        return [self.entry(rid) for rid in ids + [rid for rid in self.known if rid not in ids]]

    def _on_failed(self, rid: str, error: BaseException) -> None:
        self._spawn(self._probe(rid, f"{type(error).__name__}: {error}"))

    def _on_caught_up(self, rid: str, version: int) -> None:
        if (view := self.known.get(rid)) is not None:
            view.state, view.policy_version = "caught up", version
        log.info("remote engine %s caught up to version %d", rid, version)
        self._spawn(self._record(EngineCaughtUp(ts=time.time(), replica=rid, policy_version=version)))

    async def _probe(self, rid: str, why: str) -> None:
        """After a failure: lost when ``/health`` does not answer twice, a second apart."""
        for attempt in range(2):
            problem = await self._health(rid)
            if problem is None:
                return
            self._fleet.end_calls(rid, f"its /health probe failed ({problem})")
            if attempt == 0:
                await asyncio.sleep(1.0)
        await self.lose(rid, f"{why}; then /health did not answer ({problem})")

    async def _health(self, rid: str) -> str | None:
        """None if replica ``rid`` answers ``/health``; else what went wrong."""
        view = self.known.get(rid)
        if view is None or self._session is None:
            return None
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            async with self._session.get(f"{view.url}/health", timeout=timeout) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self._watch_interval_s)
            try:
                await self._watch_once()
            except Exception:
                log.exception("watching the remote engines failed; trying again")

    async def _watch_once(self) -> None:
        """Probe every remote replica's ``/health`` (two misses in a row: lost), then start the
        catch-up of those behind."""
        for status in self._fleet.status():
            if not status.remote:
                continue
            problem = await self._health(status.id)
            if problem is not None:  # its calls may hang as its probe did: they end now
                self._fleet.end_calls(status.id, f"its /health probe failed ({problem})")
            misses = self._misses[status.id] = 0 if problem is None else self._misses.get(status.id, 0) + 1
            if misses >= 2:
                await self.lose(status.id, f"/health did not answer twice in a row ({problem})")
        self._fleet.catch_up_behind()

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, event: Event) -> None:
        await self._store.append([event])


def transport(engine: Engine) -> str:
    """How a remote replica's engine takes new weights: "http" (it pulls them) or "shm"."""
    return str(getattr(engine, "weights_transport", "shm"))


async def _pull_current(engine: Engine, version: int) -> None:
    """A replica's catch-up where engines pull: the newest published version (``version``, or
    newer by now), else a LoRA run's adapter of ``version``, or nothing where none is published
    yet (it serves the checkpoint's)."""
    pull = getattr(engine, "pull_current", None)
    if pull is None:
        raise EngineUnavailable("this replica cannot pull its weights; it takes the next push")
    await pull()
    adapter = getattr(engine, "pull_current_adapter", None)
    if engine.policy_version != version and adapter is not None:
        await adapter(version)  # a LoRA run publishes adapters, not whole weights


def remote_replicas(
    config: ApplianceConfig,
    fleet: EngineFleet,
    store: EventStore,
    model: str,
    model_dir: Path,
    pull: Callable[[], PullSource] | None = None,
) -> RemoteReplicas:
    """The run's remote replicas: each attached as the factory attaches one
    (``factory.remote_engine``), pulling its weights from ``pull()`` (a ``PullSource``, made when
    the first replica attaches: the proxy's URL is known by then) where given (then a catch-up
    is a pull of the newest version), else taking pushes through shared memory."""

    def make_engine(url: str, served_name: str, version: int) -> Engine:
        options: dict[str, Any] = {} if pull is None else {"pull": pull()}
        return remote_engine(config, model_dir, url, served_name, version, **options)

    replicas = RemoteReplicas(
        fleet, store, model=model, model_dir=model_dir, make_engine=make_engine, pulls=pull is not None
    )
    if pull is not None:  # where the engines publish a LoRA run's adapters (``vllm_pull_adapter``)
        replicas.adapters = AdapterPublication(adapters_beside(config.data_dir / "weights"))
    return replicas


def pull_source(
    config: ApplianceConfig, proxy_url: Callable[[], str], token: str
) -> tuple[WeightPublication | None, Callable[[], PullSource] | None]:
    """Where remote replicas pull their weights from (``[engine] remote_weights = "http"``): the
    publication under ``<data_dir>/weights`` and a maker of the ``PullSource`` at
    ``weights_url`` (else the proxy's URL, its host name where it listens on every address);
    ``(None, None)`` where they take pushes through shared memory."""
    if config.engine.remote_weights != "http":
        return None, None
    publication = WeightPublication(config.data_dir / "weights")

    def source() -> PullSource:
        given = config.engine.weights_url
        url = remote_url(given) if given else reachable(proxy_url())
        return PullSource(url=url, token=token, publication=publication)

    return publication, source


def reachable(url: str) -> str:
    """``url`` with a wildcard host (``0.0.0.0``, ``::``) replaced by this machine's name."""
    parts = urlsplit(url)
    if parts.hostname not in ("0.0.0.0", "::"):
        return url
    return f"{parts.scheme}://{socket.getfqdn()}:{parts.port}"
