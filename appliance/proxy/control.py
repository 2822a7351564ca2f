"""Operator control and per-call rewards over HTTP.

Owns two routes' logic:

* ``POST /admin/control`` (admin token), body ``{"action": "pause" | "resume" | "checkpoint" |
  "stop", "source": "<who>"?}``: appends ``ControlRequested`` and answers ``202`` with the
  action and the event's position only once the event is durable. The scheduler reacts to the
  event from the log (``RunState.paused`` / ``checkpoint_requested`` / ``stop_requested``);
  this module never touches the scheduler.
* The intermediate-reward branch of ``POST /rollouts/<id>/reward``: a body with ``call_id``
  (the id of one of the rollout's calls, bare or as the surface shows it, e.g.
  ``chatcmpl-<id>``) records ``CallRewardReported`` instead of the rollout's reward.

It also owns the app key through which the admin status reads the run's live state.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from appliance.proxy.http import CALLS, check_admin, json_body
from appliance.rollouts.registry import ActiveRollout
from contracts.errors import BadRequest, NotFound
from store.events import CallRewardReported, ControlRequested, LLMCallCompleted
from store.projections import RunState

ACTIONS = ("pause", "resume", "checkpoint", "stop")
#: Prefixes the surfaces put before a call id in their response ids.
ID_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "msg_")

#: The run's live state (folded from the log), set by the appliance; absent in bare proxies.
RUN_STATE = web.AppKey("run_state", RunState)


async def control(request: web.Request) -> web.Response:
    check_admin(request)
    body = await json_body(request)
    action = body.get("action")
    if action not in ACTIONS:
        raise BadRequest(f"'action' must be one of {', '.join(ACTIONS)}; got {action!r}", param="action")
    source = body.get("source", "admin")
    if not isinstance(source, str) or not 0 < len(source) <= 64:
        raise BadRequest("'source' must be a string of 1 to 64 characters", param="source")
    store = request.app[CALLS].store
    (position,) = await store.append([ControlRequested(ts=time.time(), action=action, source=source)])
    return web.json_response({"action": action, "position": position}, status=202)


def _bare_call_id(value: str) -> str:
    for prefix in ID_PREFIXES:
        if value.startswith(prefix):
            return value[len(prefix) :]
    return value


async def report_call_reward(
    request: web.Request, rollout: ActiveRollout, body: dict[str, Any], reward: float
) -> web.Response:
    """Record ``reward`` (already checked to be finite) for the call the body's ``call_id``
    names; 404 when the rollout made no such call."""
    raw = body.get("call_id")
    if not isinstance(raw, str) or not raw:
        raise BadRequest("'call_id' must be a non-empty string", param="call_id")
    name = body.get("name", "")
    if not isinstance(name, str) or len(name) > 64:
        raise BadRequest("'name' must be a string of at most 64 characters", param="name")
    call_id = _bare_call_id(raw)
    store = request.app[CALLS].store
    calls = await store.read(rollout=rollout.rollout, types={LLMCallCompleted.type})
    if not any(isinstance(s.event, LLMCallCompleted) and s.event.call_id == call_id for s in calls):
        raise NotFound(f"rollout {rollout.rollout!r} made no call {raw!r}", param="call_id")
    event = CallRewardReported(
        ts=time.time(), rollout=rollout.rollout, call_id=call_id, reward=reward, source="http", name=name
    )
    await store.append([event])
    return web.json_response({"rollout": rollout.rollout, "call_id": call_id, "reward": reward, "name": name})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/control", control)
