"""Published weights over HTTP: the routes a replica on another machine pulls a version from.

Owns three admin routes (the admin token, as every ``/admin`` route: 401 without it):

* ``GET /admin/weights/current``: ``{"version", "manifest"}`` of the newest published version
  (404 before the first);
* ``GET /admin/weights/v<N>/manifest``: version N's manifest (file names, sizes, SHA-256 and
  tensor entries; ``appliance.engines.weight_publication.Manifest``);
* ``GET /admin/weights/v<N>/<file>``: one of its files, streamed from disk (ranges honoured, so
  a cut-off download can resume).

A file is looked up only among the names the version's manifest lists, so no part of a request
reaches the file system as a path; an unknown version or file is a 404. What is published and
kept is ``appliance.engines.weight_publication``; the composition root hands the publication to
the app with ``serve``.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from appliance.engines.weight_publication import WeightPublication
from appliance.proxy.http import check_admin
from contracts.errors import NotFound


@dataclass(slots=True)
class _Slot:
    """Where the app finds the publication (set after the app is built, by ``serve``)."""

    publication: WeightPublication | None = None


PUBLICATION = web.AppKey("weight_publication", _Slot)


def serve(app: web.Application, publication: WeightPublication | None) -> None:
    """Serve ``publication``'s versions from ``app`` (None: none, every route a 404)."""
    app[PUBLICATION].publication = publication


def _publication(request: web.Request) -> WeightPublication:
    check_admin(request)
    publication = request.app[PUBLICATION].publication
    if publication is None:
        raise NotFound("this appliance publishes no weights over HTTP")
    return publication


def _version(request: web.Request) -> int:
    return int(request.match_info["version"])  # the route's pattern holds digits only


async def current(request: web.Request) -> web.Response:
    manifest = _publication(request).current
    if manifest is None:
        raise NotFound("no weights have been published yet")
    return web.json_response({"version": manifest.version, "manifest": manifest.to_json()})


async def manifest(request: web.Request) -> web.Response:
    version = _version(request)
    found = _publication(request).manifest(version)
    if found is None:
        raise NotFound(f"weights v{version} are not published (or no longer kept)")
    return web.json_response(found.to_json())


async def weight_file(request: web.Request) -> web.FileResponse:
    version, name = _version(request), request.match_info["name"]
    path = _publication(request).file_path(version, name)
    if path is None or not path.is_file():
        raise NotFound(f"weights v{version} have no file {name!r} (or are no longer kept)")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


def add_routes(app: web.Application) -> None:
    app[PUBLICATION] = _Slot()
    app.router.add_get("/admin/weights/current", current)
    app.router.add_get(r"/admin/weights/v{version:\d{1,18}}/manifest", manifest)
    app.router.add_get(r"/admin/weights/v{version:\d{1,18}}/{name}", weight_file)
