"""Refused model calls: the errors the proxy answers a rollout's model calls with, recorded.

Owns ``LLMCallRefused``: where an error answer is made (``server.error_response``, and a stream
that fails after its headers in ``driver``) it is noted on the request (:func:`note`), and the
outermost middleware (:func:`middleware`) records it once the answer is built, before a whole
answer is sent, so a harness never sees a refusal the log does not hold. It also counts the
refusal on the live rollout (``ActiveRollout.refused``), which the rollout controller reads when
the agent ends (``appliance.rollouts.controller.calls_verdict``), and a call an engine replica
broke off mid-way (``ReplicaLost``) as the rollout's reason to fail (``ActiveRollout.lost``).

Recorded: model calls (``MODEL_CALL_ROUTES``, POST) of a rollout whose key was accepted. Not
recorded: the rollout-less ``/v1`` routes, a request refused before its rollout was known (a
wrong key, an unknown or ended rollout), a client that went away (its call is recorded as
cancelled), other routes (rewards, token counts, heartbeats).
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from appliance.proxy.http import CALLS, PREFIXES, Handler, authorised_rollout
from appliance.rollouts.registry import DEFAULT_ROLLOUT
from contracts.errors import ApplianceError, ReplicaLost
from store.events import LLMCallRefused

log = logging.getLogger(__name__)

#: The model-call routes, after a rollout's base URL.
MODEL_CALL_ROUTES = ("/chat/completions", "/completions", "/responses", "/messages")
#: Characters of the error's first line kept in the event.
MESSAGE_CHARS = 500
#: Statuses a client retries (``Retry-After``): the appliance was unavailable, the call not wrong.
RETRYABLE = (429, 503)

_REFUSAL = web.RequestKey("refusal", ApplianceError)


def note(request: web.Request, error: ApplianceError) -> None:
    """The answer to ``request`` is ``error`` (recorded by :func:`middleware` if it is a
    rollout's model call)."""
    request[_REFUSAL] = error


def noted(request: web.Request) -> ApplianceError | None:
    """The error :func:`note` gave as the answer to ``request``, if any."""
    return request.get(_REFUSAL)


def model_call_route(request: web.Request) -> str | None:
    """The model-call route ``request`` is for, after its rollout's base URL; None otherwise."""
    if request.method != "POST" or request.match_info.route.resource is None:
        return None
    path = request.match_info.route.resource.canonical
    prefix = PREFIXES[0]
    if not path.startswith(prefix) or path[len(prefix) :] not in MODEL_CALL_ROUTES:
        return None
    return path[len(prefix) :]


def refusal(rollout: str, route: str, status: int, error: ApplianceError) -> LLMCallRefused:
    lines = error.message.strip().splitlines()
    return LLMCallRefused(
        ts=time.time(),
        rollout=rollout,
        route=route,
        status=status,
        code=error.code or "",
        error_type=error.error_type,
        message=lines[0][:MESSAGE_CHARS] if lines else "",
    )


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    error = request.get(_REFUSAL)
    if error is None:
        return response
    active = authorised_rollout(request)
    route = model_call_route(request)
    if active is None or active.rollout == DEFAULT_ROLLOUT or route is None:
        return response
    event = refusal(active.rollout, route, response.status, error)
    active.refused += 1
    active.unavailable += error.status in RETRYABLE
    active.last_refusal = event.reason()
    if isinstance(error, ReplicaLost) and not active.lost:
        active.lost = event.message  # the rollout fails with it, whatever the agent does next
    try:
        await request.app[CALLS].store.append([event])
    except Exception:  # the answer still goes out; the count above still fails the rollout
        log.exception("could not record the refused call of rollout %s", active.rollout)
    return response
