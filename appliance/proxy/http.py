"""HTTP plumbing shared by every API surface: app state keys, auth, JSON bodies, SSE.

Owns how a request is tied to a rollout (the rollout id in the path, its token as
``Authorization: Bearer`` or ``x-api-key``; the rollout-less ``/v1`` prefix takes the admin
token), how a body is read as JSON, and how server-sent events are written. Surfaces import
these; nothing here knows any surface's shapes.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from appliance.errors import BadRequest, Unauthorized
from appliance.proxy.calls import CallService
from appliance.rollouts import DEFAULT_ROLLOUT, ActiveRollout, RolloutRegistry


@dataclass(frozen=True, slots=True)
class ProxySettings:
    model_name: str
    max_tokens_default: int
    max_tokens_cap: int
    #: The temperature used for training samples whatever the client asks (None: the client's).
    temperature_override: float | None
    #: Token for the admin API and the rollout-less ``/v1`` routes.
    admin_token: str = ""
    max_body_bytes: int = 4 * 1024 * 1024


CALLS = web.AppKey("calls", CallService)
REGISTRY = web.AppKey("registry", RolloutRegistry)
SETTINGS = web.AppKey("settings", ProxySettings)

__all__ = ["CALLS", "DEFAULT_ROLLOUT", "REGISTRY", "SETTINGS", "ProxySettings"]


def request_token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def check_admin(request: web.Request) -> None:
    expected = request.app[SETTINGS].admin_token
    token = request_token(request)
    if not expected or not token or not hmac.compare_digest(token.encode(), expected.encode()):
        raise Unauthorized("this route needs the admin token (see the data directory's admin_token file)")


def rollout_of(request: web.Request) -> ActiveRollout:
    """The rollout the request is for, authorised by its own token (or the admin token on /v1)."""
    registry = request.app[REGISTRY]
    rollout = request.match_info.get("rollout")
    if rollout is None:
        check_admin(request)
        return registry.default()
    return registry.authorize(rollout, request_token(request))


async def json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def sse_start(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
    )
    await response.prepare(request)
    return response


async def sse_send(response: web.StreamResponse, data: Any, event: str | None = None) -> None:
    """One server-sent event; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    await response.write(f"{head}data: {payload}\n\n".encode())


#: Every surface is served under the rollout's base URL and under the rollout-less prefix.
PREFIXES = ("/rollouts/{rollout}/v1", "/v1")


def add_post(app: web.Application, path: str, handler: Any) -> None:
    for prefix in PREFIXES:
        app.router.add_post(prefix + path, handler)


def add_get(app: web.Application, path: str, handler: Any) -> None:
    for prefix in PREFIXES:
        app.router.add_get(prefix + path, handler)


def user_agent(request: web.Request) -> str:
    return request.headers.get("User-Agent", "")
