"""The admin event feed: ``GET /admin/events?after=<position>&limit=<n>[&rollout=<id>]`` (admin token).

Owns the read-only HTTP view of the event log that ``lightning-appliance tui --url`` polls. Each
event goes out as its stored row (``store.codec.encode``): ``type``, ``version``, ``ts``, the JSON
``data`` string and the packed ``blob`` in base64, so a client rebuilds it with
``store.codec.decode`` exactly as the store would. With ``rollout``, only that rollout's events
(how the dashboard reads the calls of a rollout its state no longer holds). It never writes; it
does not own the event types, the codec or the store.
"""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from appliance.proxy.http import CALLS, check_admin
from contracts.errors import BadRequest
from store.codec import StoredEvent, encode

#: Most events one request returns (a client pages with ``after``).
MAX_LIMIT = 2000
DEFAULT_LIMIT = 500


def stored_to_json(stored: StoredEvent) -> dict[str, Any]:
    """One stored event as the feed sends it."""
    row = encode(stored.event)
    return {
        "position": stored.position,
        "type": row.type,
        "version": row.version,
        "ts": row.ts,
        "data": row.data,
        "blob": base64.b64encode(row.blob).decode("ascii"),
    }


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"'{name}' must be an integer, got {raw!r}", param=name) from None
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return value


async def admin_events(request: web.Request) -> web.Response:
    """The durable events after ``after`` (default 0), at most ``limit``, in order; only those of
    ``rollout`` when it is given."""
    check_admin(request)
    after = _int_param(request, "after", 0, 0, 2**62)
    limit = _int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    rollout = request.query.get("rollout")
    if rollout is not None and not rollout:
        raise BadRequest("'rollout' must not be empty", param="rollout")
    store = request.app[CALLS].store
    page = await store.read(after, limit=limit, rollout=rollout)
    return web.json_response(
        {"events": [stored_to_json(s) for s in page], "last_position": store.last_position}
    )


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/events", admin_events)
