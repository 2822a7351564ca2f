"""Event sources the dashboard follows, and the control client it sends operator actions with.

Owns how the dashboard gets events: :class:`SqliteSource` reads a store file read-only with
``store.eventstore.read_events_sync`` (safe while the appliance writes it, and the only way a
finished run is opened), :class:`HttpSource` polls ``GET /admin/events`` of a running appliance.
Both return the events after a position, in order, a page at a time, and the recorded calls of
one rollout (those the dashboard's state dropped once the rollout was trained on, see
``store.projections.RolloutView.released``). :class:`ControlClient` posts
``{"action": ...}`` to ``POST /admin/control``. Nothing here folds events (``tui.model``) or draws.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from contracts.errors import ApplianceError, StoreError
from store.codec import StoredEvent, decode
from store.events import LLMCallCompleted
from store.eventstore import read_calls_sync, read_events_sync

#: Events fetched per poll; a larger backlog is read over several polls.
PAGE = 2000
#: The actions ``POST /admin/control`` accepts.
ACTIONS = ("pause", "resume", "checkpoint", "stop")


class EventSource(Protocol):
    """Where the dashboard's events come from."""

    #: Shown in the header: the file or URL being followed.
    label: str
    #: False for a finished run opened from its file: controls are disabled.
    live: bool

    async def poll(self, after: int, limit: int = PAGE) -> list[StoredEvent]:
        """The events with position > ``after``, in order, at most ``limit``."""
        ...

    async def calls(self, rollout: str) -> list[LLMCallCompleted]:
        """The recorded calls of ``rollout``, in order (empty for an unknown rollout)."""
        ...

    async def close(self) -> None:
        """Release connections (idempotent)."""
        ...


class SqliteSource:
    """A store file, read-only, with ``read_events_sync`` in a worker thread.

    The thread keeps decoding (token arrays, shared prompt prefixes) off the event loop, so the
    dashboard keeps answering keys while it catches up with a busy log. A poll returns at most
    ``limit`` events: a long run's file is read a page at a time, so the dashboard holds the
    run's state and one page, never the whole log.
    """

    def __init__(self, path: Path, *, live: bool = False, label: str | None = None) -> None:
        if not Path(path).is_file():
            raise StoreError(f"no event store at {path}")
        self.path = Path(path)
        self.label = label or str(path)
        self.live = live

    async def poll(self, after: int, limit: int = PAGE) -> list[StoredEvent]:
        return await asyncio.to_thread(read_events_sync, self.path, after=after, limit=limit)

    async def calls(self, rollout: str) -> list[LLMCallCompleted]:
        return await asyncio.to_thread(read_calls_sync, self.path, rollout)

    async def close(self) -> None:
        pass  # every poll opens and closes its own read-only connection


def decode_feed_event(item: dict[str, Any]) -> StoredEvent:
    """One item of ``GET /admin/events`` back into the stored event."""
    blob = base64.b64decode(item["blob"]) if item.get("blob") else b""
    event = decode(str(item["type"]), int(item["version"]), float(item["ts"]), str(item["data"]), blob)
    return StoredEvent(int(item["position"]), event)


class HttpSource:
    """A running appliance's admin event feed."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.label = self.url
        self.live = True
        self._token = token
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self._token}"}
            self._session = aiohttp.ClientSession(headers=headers, timeout=self._timeout)
        return self._session

    async def poll(self, after: int, limit: int = PAGE) -> list[StoredEvent]:
        return await self._page({"after": after, "limit": limit})

    async def calls(self, rollout: str) -> list[LLMCallCompleted]:
        calls: list[LLMCallCompleted] = []
        after = 0
        while True:
            page = await self._page({"after": after, "limit": PAGE, "rollout": rollout})
            calls += [stored.event for stored in page if isinstance(stored.event, LLMCallCompleted)]
            if len(page) < PAGE:
                return calls
            after = page[-1].position

    async def _page(self, params: dict[str, str | int]) -> list[StoredEvent]:
        url = f"{self.url}/admin/events"
        try:
            async with self._client().get(url, params=params) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise ApplianceError(f"{url}: HTTP {response.status}: {_error_message(body)}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ApplianceError(f"cannot read events from {url}: {exc}") from exc
        return [decode_feed_event(item) for item in body.get("events", [])]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ControlClient:
    """Sends operator actions to ``POST /admin/control`` (which appends ``ControlRequested``)."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def send(self, action: str) -> int:
        """Request ``action``; returns the position of the recorded event. Raises ApplianceError."""
        if action not in ACTIONS:
            raise ApplianceError(f"unknown action {action!r} (known: {', '.join(ACTIONS)})")
        url = f"{self.url}/admin/control"
        headers = {"Authorization": f"Bearer {self._token}"}
        try:
            async with (
                aiohttp.ClientSession(headers=headers, timeout=self._timeout) as session,
                session.post(url, json={"action": action, "source": "dashboard"}) as response,
            ):
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ApplianceError(f"cannot send {action!r} to {url}: {exc}") from exc
        if response.status not in (200, 202):
            raise ApplianceError(
                f"{action!r} refused by {url}: HTTP {response.status}: {_error_message(body)}"
            )
        return int(body.get("position", 0)) if isinstance(body, dict) else 0


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:200]
