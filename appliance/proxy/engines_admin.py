"""The engine fleet's admin routes: listing its replicas, registering and removing remote ones.

Owns three routes (admin token; without it a 401 as every admin route):

* ``GET /admin/engines``: ``{"engines": [{"id", "url", "remote", "state", "policy_version",
  "inflight", "rollouts"}, ...]}``, the fleet's replicas (local ones first) and the remote ones
  it lost (``state`` "lost", with the ``reason``).
* ``POST /admin/engines`` with ``{"url": "http://host:port"}``: registers a vLLM server the
  appliance did not launch (``appliance.engines.remote``); ``201`` with its entry once it is
  recorded and in the fleet (its ``state`` "behind" until it has caught up to the run's
  version), ``200`` with it when it is in the fleet already; a server that serves another
  model, lacks the worker extension or does not answer is a ``400`` whose message says so in
  one line.
* ``DELETE /admin/engines/{id}``: takes a remote replica out for good (``200``); ``404`` for an
  id the run does not know, ``409`` for a replica the appliance launched.
* ``GET /admin/adapters/v<N>/<file>``: a file of LoRA adapter version N, as remote replicas
  pulling over HTTP fetch it (``appliance.engines.adapter_publication``); ``404`` for a file or
  version not published (only the names an adapter has are looked up).

The replicas themselves are ``appliance.engines.remote``'s; this module only speaks HTTP.
"""

from __future__ import annotations

from aiohttp import web

from appliance.engines.remote import RemoteReplicas
from appliance.proxy.http import check_admin, json_body
from contracts.errors import BadRequest, Conflict, NotFound

#: The run's remote replicas, set by the appliance; absent in bare proxies.
REPLICAS = web.AppKey("replicas", RemoteReplicas)


def _replicas(request: web.Request) -> RemoteReplicas:
    check_admin(request)
    replicas = request.app.get(REPLICAS)
    if replicas is None:
        raise Conflict("this proxy serves no engine fleet")
    return replicas


async def list_engines(request: web.Request) -> web.Response:
    return web.json_response({"engines": _replicas(request).listing()})


async def register_engine(request: web.Request) -> web.Response:
    replicas = _replicas(request)
    body = await json_body(request)
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' must be the engine's http://host:port", param="url")
    before = {entry["id"] for entry in replicas.listing() if entry["state"] != "lost"}
    entry = await replicas.register(url)
    return web.json_response(entry, status=200 if entry["id"] in before else 201)


async def remove_engine(request: web.Request) -> web.Response:
    replicas = _replicas(request)
    rid = request.match_info["id"]
    if any(entry["id"] == rid and not entry["remote"] for entry in replicas.listing()):
        raise Conflict(f"replica {rid} was launched by the appliance; only remote engines can be removed")
    return web.json_response(await replicas.remove(rid))


async def adapter_file(request: web.Request) -> web.FileResponse:
    adapters = _replicas(request).adapters
    version = request.match_info["version"]
    path = None if adapters is None else adapters.path(int(version), request.match_info["name"])
    if path is None:
        raise NotFound(f"no published LoRA adapter file {request.match_info['name']!r} of v{version}")
    return web.FileResponse(path)


def attach(app: web.Application, replicas: RemoteReplicas) -> None:
    """Serve ``replicas`` on ``app``'s admin routes."""
    app[REPLICAS] = replicas
    app.router.add_get("/admin/engines", list_engines)
    app.router.add_post("/admin/engines", register_engine)
    app.router.add_delete("/admin/engines/{id}", remove_engine)
    app.router.add_get(r"/admin/adapters/v{version:\d+}/{name}", adapter_file)
