"""The HTTP face of the appliance: the application, its routes, errors, and its lifecycle.

Owns assembling the aiohttp application from the surface modules, the few routes that belong to
no surface (models, rewards, health, admin), and one middleware that turns ``ApplianceError``
and malformed input into OpenAI-shaped ``{"error": {...}}`` bodies with the right status
(Anthropic's shape for Anthropic clients: ``ApplianceError.to_openai`` / ``to_anthropic``),
including a URL or header past the proxy's limits; what aiohttp's HTTP parser refuses before
any handler is answered in JSON too (``_JsonErrors``: a URL past its limit a 414, a header a 431,
as below it), and logged as one WARNING line, at most ``MALFORMED_LOGS`` of them per interval
(``LogThrottle``): a client cannot fill the log.
Harness routes live under the rollout's base URL ``/rollouts/<rollout_id>/v1`` and under a
plain ``/v1`` for rollout-less use with the admin token; external runners claim rollouts and end
them through ``appliance.proxy.runners``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from appliance.operations.health import Health
from appliance.proxy import (
    admin_feed,
    anthropic_messages,
    control,
    endpoints,
    metrics,
    openai_chat,
    openai_completions,
    openai_responses,
    refusals,
    runners,
    weights,
)
from appliance.proxy.calls import CallService
from appliance.proxy.http import (
    ADMISSION,
    CALLS,
    HEALTH,
    REGISTRY,
    SETTINGS,
    Admission,
    ProxySettings,
    add_get,
    anthropic_client,
    check_admin,
    json_body,
    rollout_of,
)
from appliance.rollouts.registry import RolloutRegistry
from contracts.errors import ApplianceError, BadRequest, HTTPError, ModelNotFound
from store.events import RewardReported

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

__all__ = ["ProxyServer", "ProxySettings", "build_app"]


#: What the proxy reads of a request's head: a URL and each header field (name and value) of at
#: most 8 KiB. Harness requests are far below (a rollout's token is tens of bytes); a longer one
#: is a 414 or a 431 in the surface's error shape (``_oversized``).
MAX_URL_BYTES = 8192
MAX_HEADER_BYTES = 8192
#: aiohttp's parser refuses a line or a header field past these (its defaults are 8190 bytes),
#: before any handler and so before the surface is known: raised above the limits the
#: middleware applies, so that an oversized URL or header up to here gets the surface's shape;
#: past it, ``_JsonErrors`` answers (with the same status). The two differ: the limit the
#: parser names tells a URL (414) from a header (431).
PARSER_LINE_BYTES = 128 * 1024
PARSER_FIELD_BYTES = 64 * 1024
#: Requests the HTTP parser refuses are logged at most this many times per this many seconds.
MALFORMED_LOGS = (10, 60.0)


def _oversized(request: web.Request) -> HTTPError | None:
    """A 414 for a URL, a 431 for a header field, past the proxy's limits (the value is not
    repeated: it may be a credential)."""
    if len(request.raw_path) > MAX_URL_BYTES:
        return HTTPError(
            414, f"the URL is {len(request.raw_path)} bytes; at most {MAX_URL_BYTES} are read", "url_too_long"
        )
    for name, value in request.raw_headers:
        if len(name) + len(value) > MAX_HEADER_BYTES:
            return HTTPError(
                431,
                f"the {name.decode('latin-1')} header is {len(name) + len(value)} bytes; "
                f"at most {MAX_HEADER_BYTES} are read",
                "header_too_large",
            )
    return None


def error_response(request: web.Request, exc: ApplianceError) -> web.Response:
    refusals.note(request, exc)  # recorded if it answers a rollout's model call
    body = exc.to_anthropic() if anthropic_messages.is_anthropic(request) else exc.to_openai()
    response = web.json_response(body, status=exc.status)
    if exc.status in (429, 503):
        # Retryable: say when (the openai and anthropic clients honour it).
        response.headers["Retry-After"] = str(exc.retry_after_s or 1)
    return response


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    oversized = _oversized(request)
    if oversized is not None:
        return error_response(request, oversized)
    try:
        return await handler(request)
    except ApplianceError as exc:
        return error_response(request, exc)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        error = HTTPError(413, f"the request body is larger than {limit} bytes", "request_too_large")
        return error_response(request, error)
    except web.HTTPException as exc:
        if exc.status >= 400:
            code = "not_found" if exc.status == 404 else None
            return error_response(request, HTTPError(exc.status, f"{exc.reason}: {request.path}", code))
        raise
    except ConnectionError as exc:
        transport = request.transport
        if transport is not None and not transport.is_closing():
            # This client is still connected: another connection failed under the handler.
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(
                request, HTTPError(500, "internal error; see the appliance log", "internal_error")
            )
        # The client went away (a harness cancelled or timed out); its call is recorded as
        # cancelled. Routine, so one line and no traceback. Re-raising would make aiohttp log an
        # ERROR with one; the placeholder answer is never sent (aiohttp notices the closed
        # connection when it writes the status line, and drops it quietly).
        log.info(
            "%s %s: the client went away (%s: %s)", request.method, request.path, type(exc).__name__, exc
        )
        return web.Response(status=499, reason="Client Closed Request")
    except asyncio.CancelledError:
        # aiohttp cancels the handler of a client that went away (``handler_cancellation``);
        # the call path has recorded the call as cancelled. The same at shutdown.
        transport = request.transport
        if transport is None or transport.is_closing():
            log.info("%s %s: the client went away; the call was cancelled", request.method, request.path)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(
            request, HTTPError(500, "internal error; see the appliance log", "internal_error")
        )


def _model_object(request: web.Request, name: str) -> dict[str, Any]:
    """A served model as OpenAI's Model object, or Anthropic's to an Anthropic client."""
    if anthropic_client(request):
        return {
            "type": "model",
            "id": name,
            "display_name": name,
            "created_at": "1970-01-01T00:00:00Z",
            "lifecycle": "active",
        }
    return {"id": name, "object": "model", "created": 0, "owned_by": "lightning-appliance"}


async def list_models(request: web.Request) -> web.Response:
    """Every name the policy answers to (``served_model_names``), the one harnesses are given
    first."""
    rollout_of(request)
    names = request.app[SETTINGS].served_names
    models = [_model_object(request, name) for name in names]
    if anthropic_client(request):
        return web.json_response(
            {"data": models, "has_more": False, "first_id": names[0], "last_id": names[-1]}
        )
    return web.json_response({"object": "list", "data": models})


async def retrieve_model(request: web.Request) -> web.Response:
    rollout_of(request)
    names = request.app[SETTINGS].served_names
    wanted = request.match_info["model"]
    if wanted not in names:
        served = ", ".join(f"'{name}'" for name in names)
        raise ModelNotFound(
            f"The model '{wanted}' does not exist; this appliance serves {served}", param="model"
        )
    return web.json_response(_model_object(request, wanted))


async def report_reward(request: web.Request) -> web.Response:
    rollout = rollout_of(request)
    body = await json_body(request)
    reward = body.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise BadRequest("'reward' must be a finite number", param="reward")
    if "call_id" in body:  # an intermediate reward on one call, not the rollout's
        return await control.report_call_reward(request, rollout, body, float(reward))
    event = RewardReported(ts=time.time(), rollout=rollout.rollout, reward=float(reward), source="http")
    await request.app[CALLS].store.append([event])
    rollout.reward = float(reward)
    return web.json_response({"rollout": rollout.rollout, "reward": float(reward)})


async def admin_status(request: web.Request) -> web.Response:
    """The live rollouts and the serving gate; the full run state is in the event log."""
    check_admin(request)
    calls = request.app[CALLS]
    run = request.app.get(control.RUN_STATE)
    return web.json_response(
        {
            "paused": run.paused if run is not None else False,
            "rollouts": len(request.app[REGISTRY]),
            # Of those, offered to external runners and not claimed yet.
            "offered": board.offered if (board := request.app.get(runners.RUNNERS)) else 0,
            "serving": calls.gate.is_open,
            "inflight": calls.gate.inflight,
            "policy_version": calls.engine.policy_version,
            "events": calls.store.last_position,
            "calls_held": request.app[ADMISSION].held,
            "calls_refused": request.app[ADMISSION].refused,
        }
    )


async def health(request: web.Request) -> web.Response:
    """200 while the appliance is healthy, 503 with the reasons while something is wedged or
    held (a switch phase past its deadline, admissions paused by the circuit breaker)."""
    report = {**request.app[HEALTH].report(), "rollouts": len(request.app[REGISTRY])}
    return web.json_response(report, status=200 if request.app[HEALTH].ok else 503)


def build_app(
    calls: CallService, registry: RolloutRegistry, settings: ProxySettings, conditions: Health | None = None
) -> web.Application:
    app = web.Application(
        middlewares=[metrics.middleware, refusals.middleware, errors_middleware, endpoints.middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[HEALTH] = conditions or Health()
    app[CALLS] = calls
    app[REGISTRY] = registry
    app[SETTINGS] = settings
    app[ADMISSION] = Admission(settings.max_queued_calls)
    openai_chat.add_routes(app)
    openai_completions.add_routes(app)
    openai_responses.add_routes(app)
    anthropic_messages.add_routes(app)
    add_get(app, "/models", list_models)
    # A model id may hold slashes ("Qwen/Qwen3-8B"), so the rest of the path is the id.
    add_get(app, "/models/{model:.+}", retrieve_model)
    app.router.add_post("/rollouts/{rollout}/reward", report_reward)
    app.router.add_get("/healthz", health)
    app.router.add_get("/admin/status", admin_status)
    admin_feed.add_routes(app)
    control.add_routes(app)
    runners.add_routes(app)
    weights.add_routes(app)  # GET /admin/weights/...: published versions, for replicas to pull
    metrics.attach(app)  # GET /metrics
    return app


class LogThrottle:
    """Log lines of one kind, at most ``most`` per ``interval_s``: the lines held back past it are
    counted, and the first line written after them says how many there were."""

    def __init__(
        self,
        logger: logging.Logger,
        most: int,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self._most, self._interval_s, self._clock = logger, most, interval_s, clock
        self._since = -math.inf
        self._written = 0
        self.held_back = 0

    def warning(self, text: str) -> None:
        now = self._clock()
        if now - self._since >= self._interval_s:
            self._since, self._written = now, 0
        if self._written >= self._most:
            self.held_back += 1
            return
        self._written += 1
        if self.held_back:
            text += f" ({self.held_back} more like it not logged before this one)"
            self.held_back = 0
        self._log.warning("%s", text)


def _parser_error(status: int, exc: BaseException | None) -> HTTPError:
    """What the HTTP parser refused, as the middleware words the same refusal: a URL or a header
    past the parser's limits a 414 or a 431; anything else a 400 naming the parser's exception
    (its message is not repeated: it quotes the line, which may be a credential)."""
    if isinstance(exc, LineTooLong) and status < 500:
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == PARSER_LINE_BYTES:
            text = f"the URL is over {PARSER_LINE_BYTES} bytes; at most {MAX_URL_BYTES} are read"
            return HTTPError(414, text, "url_too_long")
        text = f"a header is over {PARSER_FIELD_BYTES} bytes; at most {MAX_HEADER_BYTES} are read"
        return HTTPError(431, text, "header_too_large")
    if status < 500:
        text = f"the request could not be read as HTTP ({type(exc).__name__}); the URL and "
        text += f"each header are read up to {MAX_URL_BYTES} bytes"
        return HTTPError(status, text, "invalid_request")
    return HTTPError(status, "internal error; see the appliance log", "internal_error")


class _JsonErrors(RequestHandler):
    """aiohttp's protocol handler, answering what its HTTP parser refuses (a line or header too
    long, a malformed request) in JSON instead of plain text. The path is not known by then, so
    the body is the one both dialects parse: Anthropic's ``{"type": "error", "error": {...}}``
    whose error object also carries OpenAI's fields. A refused request is the client's doing:
    one WARNING line, throttled (``malformed``), never a traceback; a 500 is logged as aiohttp
    logs it."""

    malformed: LogThrottle

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        error = _parser_error(status, exc)
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logs; raises if the answer began
        else:
            self.malformed.warning(
                f"refused a request from {request.remote} that could not be read as HTTP: "
                f"{error.status} {type(exc).__name__}"
            )
            if request.writer.output_size > 0:
                raise ConnectionError("the answer had begun; the error cannot be sent")
        anthropic = error.to_anthropic()
        body = {**anthropic, "error": {**anthropic["error"], **error.openai_error()}}
        response = web.json_response(body, status=error.status)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    malformed: LogThrottle

    def __call__(self) -> RequestHandler:
        handler = _JsonErrors(self, loop=self._loop, **self._kwargs)
        handler.malformed = self.malformed
        return handler


class _Runner(web.AppRunner):
    """``AppRunner`` whose connections are handled by ``_JsonErrors``, sharing one throttle."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        assert isinstance(server, _JsonErrorServer)
        server.malformed = LogThrottle(log, *MALFORMED_LOGS)
        return server


class ProxyServer:
    """Runs the aiohttp app beside the rest of the appliance (``AppRunner`` + ``TCPSite``)."""

    def __init__(
        self, app: web.Application, host: str, port: int, *, shutdown_timeout_s: float = 2.0
    ) -> None:
        # A client that goes away cancels its call (recorded as cancelled), and a call still
        # running at close (an engine request that never returns) is cancelled after
        # ``shutdown_timeout_s``: aiohttp's default, 60 s, is past any stop's bound.
        self._runner = _Runner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=shutdown_timeout_s,
            max_line_size=PARSER_LINE_BYTES,
            max_field_size=PARSER_FIELD_BYTES,
        )
        self._host = host
        self._port = port
        self.url = ""
        #: Unix sockets of sandboxed rollouts, each serving its rollout's routes only.
        self.sockets = endpoints.RolloutSockets(self._runner)
        app[endpoints.SOCKETS] = self.sockets

    async def start(self) -> None:
        await self._runner.setup()
        # A deep accept queue: a thousand harness connections may open at the same moment.
        site = web.TCPSite(self._runner, self._host, self._port, backlog=4096)
        await site.start()
        port = self._port
        for address in self._runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                port = int(address[1])
                break
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.url = f"http://{host}:{port}"

    async def close(self) -> None:
        await self.sockets.close_all()
        await self._runner.cleanup()
