"""The HTTP face of the appliance: routes, auth, errors, and the server's lifecycle.

Owns the aiohttp application. Every harness-facing route lives under the rollout's base URL
``/rollouts/<rollout_id>/v1`` and is authorised by that rollout's own token (Bearer or
``x-api-key``). One middleware turns ``ApplianceError`` and malformed input into OpenAI-shaped
``{"error": {...}}`` bodies with the right status; nothing here knows about tokens or engines
beyond handing the request to ``CallService``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from appliance.errors import ApplianceError, BadRequest
from appliance.proxy import openai_chat
from appliance.proxy.calls import CallService
from appliance.rollouts import ActiveRollout, RolloutRegistry
from store.events import RewardReported

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ProxySettings:
    model_name: str
    max_tokens_default: int
    max_tokens_cap: int
    #: The temperature used for training samples whatever the client asks (None: the client's).
    temperature_override: float | None
    max_body_bytes: int = 4 * 1024 * 1024


CALLS = web.AppKey("calls", CallService)
REGISTRY = web.AppKey("registry", RolloutRegistry)
SETTINGS = web.AppKey("settings", ProxySettings)


def error_body(
    status: int, message: str, error_type: str, code: str | None, param: str | None
) -> web.Response:
    payload = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return web.json_response(payload, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApplianceError as exc:
        return error_body(exc.status, exc.message, exc.error_type, exc.code, exc.param)
    except web.HTTPRequestEntityTooLarge:
        return error_body(
            413, "the request body is too large", "invalid_request_error", "request_too_large", None
        )
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_body(exc.status, exc.reason, "invalid_request_error", None, None)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_body(
            500, "internal error; see the appliance log", "server_error", "internal_error", None
        )


def _token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _rollout(request: web.Request) -> ActiveRollout:
    return request.app[REGISTRY].authorize(request.match_info["rollout"], _token(request))


async def _json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def chat_completions(request: web.Request) -> web.Response:
    rollout = _rollout(request)
    settings = request.app[SETTINGS]
    body, messages, tools = openai_chat.parse_request(await _json(request))
    params = openai_chat.parse_sampling(
        body,
        max_tokens_default=settings.max_tokens_default,
        max_tokens_cap=settings.max_tokens_cap,
        temperature_override=settings.temperature_override,
    )
    outcome = await request.app[CALLS].complete(
        rollout,
        messages=messages,
        tools=tools,
        params=params,
        surface=openai_chat.SURFACE,
        request=body,
        user_agent=request.headers.get("User-Agent", ""),
    )
    return web.json_response(openai_chat.completion_body(outcome, body["model"]))


async def list_models(request: web.Request) -> web.Response:
    _rollout(request)
    name = request.app[SETTINGS].model_name
    model = {"id": name, "object": "model", "created": 0, "owned_by": "lightning-appliance"}
    return web.json_response({"object": "list", "data": [model]})


async def report_reward(request: web.Request) -> web.Response:
    rollout = _rollout(request)
    body = await _json(request)
    reward = body.get("reward") if isinstance(body, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
        raise BadRequest("'reward' must be a finite number", param="reward")
    event = RewardReported(ts=time.time(), rollout=rollout.rollout, reward=float(reward), source="http")
    await request.app[CALLS].store.append([event])
    rollout.reward = float(reward)
    return web.json_response({"rollout": rollout.rollout, "reward": float(reward)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "rollouts": len(request.app[REGISTRY])})


def build_app(calls: CallService, registry: RolloutRegistry, settings: ProxySettings) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=settings.max_body_bytes)
    app[CALLS] = calls
    app[REGISTRY] = registry
    app[SETTINGS] = settings
    base = "/rollouts/{rollout}"
    app.router.add_post(base + "/v1/chat/completions", chat_completions)
    app.router.add_get(base + "/v1/models", list_models)
    app.router.add_post(base + "/reward", report_reward)
    app.router.add_get("/healthz", health)
    return app


class ProxyServer:
    """Runs the aiohttp app beside the rest of the appliance (``AppRunner`` + ``TCPSite``)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._host = host
        self._port = port
        self.url = ""

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        port = sockets[0].getsockname()[1] if sockets else self._port
        self.url = f"http://{self._host}:{port}"

    async def close(self) -> None:
        await self._runner.cleanup()
