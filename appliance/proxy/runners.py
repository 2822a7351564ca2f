"""External runners over HTTP: claiming a rollout, its heartbeats, and its end.

Owns three routes' logic (the board behind them is ``appliance.rollouts.external``):

* ``POST /admin/rollouts`` (admin token), body ``{}`` (the oldest offered rollout) or
  ``{"task": {...}}`` (a rollout of a group on this task, queued ahead of the task set): answers
  ``201 {"rollout_id", "base_url", "api_key", "model", "task_id", "task", "lease_s"}``, where
  ``base_url`` is the rollout's OpenAI/Anthropic base URL (``<proxy>/rollouts/<id>/v1``, on the
  host and port the request reached); ``503`` with ``Retry-After`` when nothing was offered
  within ``runner_claim_wait_s``; ``409`` when the appliance runs its own agents.
* ``POST /rollouts/<id>/heartbeat`` (the rollout's key), empty body: a sign of life that keeps
  its lease (``200 {"rollout_id", "lease_s"}``).
* ``POST /rollouts/<id>/finish`` (the rollout's key), body ``{"status": "finished" | "failed",
  "reason"?: str}``: ends the rollout; answers ``200`` once its ``RolloutFinished`` is recorded
  (a failed one carries the reason) with the status and reason the log holds (a rollout its
  runner finished is failed when it made no model call or the proxy refused its calls).
  Finishing it again is a ``409``.

Rewards go to ``POST /rollouts/<id>/reward`` as for any rollout. Bad input is a ``400`` naming
the field; a wrong key a ``401``; a rollout that has ended a ``409`` on every route (a model call,
a reward, a heartbeat, a finish) to its own key; a rollout that never existed the same ``401`` as
a wrong key (rollout ids are not secret, so they cannot be probed).
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from aiohttp import web

from appliance.proxy.http import (
    CALLS,
    REGISTRY,
    SETTINGS,
    authorize,
    check_admin,
    json_body,
    request_token,
    wrong_key,
)
from appliance.rollouts.external import RunnerBoard, task_from
from appliance.rollouts.registry import ActiveRollout
from contracts.errors import BadRequest, Conflict
from store.events import RolloutClaimed

#: The board of the ``external`` adapter, set by the appliance; absent when it runs its own agents.
RUNNERS = web.AppKey("runners", RunnerBoard)
STATUSES = ("finished", "failed")
#: Characters of a failure's reason kept (the controller records 2,000 with its prefix).
MAX_REASON = 1500


def _board(request: web.Request) -> RunnerBoard:
    board = request.app.get(RUNNERS)
    if board is None:
        raise Conflict(
            "this appliance runs its own agents; external runners need the external adapter "
            '([adapter] adapter = "external", or APPLIANCE_ADAPTER=external)'
        )
    return board


def _only(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for name in body:
        if name not in allowed:
            raise BadRequest(f"unknown field {name!r}; allowed: {', '.join(allowed)}", param=name)


async def claim(request: web.Request) -> web.Response:
    check_admin(request)
    board = _board(request)
    body = await json_body(request)
    _only(body, ("task",))
    task = None
    if "task" in body:
        data = body["task"]
        if not isinstance(data, dict):
            raise BadRequest("'task' must be a JSON object (the task's fields)", param="task")
        task = task_from(data)
    offer = await board.claim(task)
    rollout = offer.client.rollout_id
    # From here on the log shows the rollout running, no longer offered (``store.outcomes``).
    await request.app[CALLS].store.append([RolloutClaimed(ts=time.time(), rollout=rollout)])
    base = f"{request.url.origin()}/rollouts/{rollout}"
    return web.json_response(
        {
            "rollout_id": rollout,
            "base_url": base + "/v1",
            "api_key": offer.client.api_key,
            "model": request.app[SETTINGS].model_name,
            "task_id": offer.task.id,
            "task": offer.task.data,
            "lease_s": board.lease_s,
        },
        status=201,
    )


def _authorized(request: web.Request, board: RunnerBoard) -> ActiveRollout:
    """The live rollout the path names, authorised by its key; a rollout that already ended is a
    409 (to its own key, saying how it ended), one that never existed a 401 as a wrong key is
    (``http.authorize``'s rule for every rollout route)."""
    rollout = request.match_info["rollout"]
    token = request_token(request)
    registry = request.app[REGISTRY]
    if registry.get(rollout) is None:
        ended = board.ended(rollout)
        if ended is None:
            return authorize(registry, rollout, token)  # 409 if it ended, else 401
        key, status = ended
        if not token or not hmac.compare_digest(token.encode(), key.encode()):
            raise wrong_key(rollout)
        raise Conflict(
            f"rollout {rollout!r} has already ended ({status}); it takes no more model calls, "
            "rewards, heartbeats or finishes"
        )
    return authorize(registry, rollout, token)


async def heartbeat(request: web.Request) -> web.Response:
    board = _board(request)
    active = _authorized(request, board)  # authorising it is the sign of life
    if board.offer_of(active.rollout) is None:
        raise Conflict(f"rollout {active.rollout!r} is not run by an external runner")
    return web.json_response({"rollout_id": active.rollout, "lease_s": board.lease_s})


async def finish(request: web.Request) -> web.Response:
    board = _board(request)
    active = _authorized(request, board)
    body = await json_body(request)
    _only(body, ("status", "reason"))
    status = body.get("status")
    if status not in STATUSES:
        raise BadRequest(f"'status' must be one of {', '.join(STATUSES)}; got {status!r}", param="status")
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        raise BadRequest("'reason' must be a string", param="reason")
    offer = board.offer_of(active.rollout)
    if offer is None:
        raise Conflict(f"rollout {active.rollout!r} is not run by an external runner")
    if status == "failed":
        reason = f"its external runner failed it: {reason[-MAX_REASON:] or 'no reason given'}"
    else:
        reason = ""
    board.finish(offer, status, reason)
    await board.recorded(active.rollout)
    # Answer what the log holds: a rollout its runner finished may have been failed (for example
    # because the proxy refused every model call it made).
    status, reason = board.recorded_end(active.rollout) or (status, reason)
    return web.json_response({"rollout_id": active.rollout, "status": status, "reason": reason})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/rollouts", claim)
    app.router.add_post("/rollouts/{rollout}/heartbeat", heartbeat)
    app.router.add_post("/rollouts/{rollout}/finish", finish)
