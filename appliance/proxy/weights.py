"""Published weights over HTTP: the routes a replica on another machine pulls a version from.

Owns four admin routes (the admin token, as every ``/admin`` route: 401 without it):

* ``GET /admin/weights/current``: ``{"version", "manifest"}`` of the newest published version
  (404 before the first);
* ``GET /admin/weights/v<N>/manifest``: version N's manifest (file names, sizes, SHA-256 and
  tensor entries; ``appliance.engines.weight_publication.Manifest``);
* ``GET /admin/weights/v<N>/files``: version N's files as JSON lines, each (a manifest's file
  entry) as soon as it is whole, while the version is still being written: the pipelined pull
  fetches file i while file i+1 is written. The last line says how it ended: ``{"version",
  "files", "bytes"}`` once complete, ``{"error"}`` if the write failed (the files listed before
  it must not be loaded); a body cut before either is a pull that failed;
* ``GET /admin/weights/v<N>/<file>``: one of its files, streamed from disk with ``sendfile``
  (ranges honoured for a complete version, so a cut-off download can resume).

A file is looked up only among the names the version's manifest lists (or, while it is written,
the files already whole, so a file is never served half-written), so no part of a request
reaches the file system as a path; an unknown version or file is a 404. What is published and
kept is ``appliance.engines.weight_publication``; the composition root hands the publication to
the app with ``serve``.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

from aiohttp import web

from appliance.engines.weight_publication import PublicationFailed, WeightPublication
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


async def files(request: web.Request) -> web.StreamResponse:
    version = _version(request)
    publication = _publication(request)
    if not publication.known(version):
        raise NotFound(f"weights v{version} are not published (or no longer kept)")
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    count = size = 0
    try:
        async for file in publication.files_of(version):
            count, size = count + 1, size + file.bytes
            await response.write(json.dumps(file.to_json()).encode() + b"\n")
        last: dict[str, object] = {"version": version, "files": count, "bytes": size}
    except (PublicationFailed, KeyError) as exc:
        last = {"error": str(exc) if isinstance(exc, PublicationFailed) else f"weights v{version} are gone"}
    await response.write(json.dumps(last).encode() + b"\n")
    await response.write_eof()
    return response


async def weight_file(request: web.Request) -> web.StreamResponse:
    version, name = _version(request), request.match_info["name"]
    publication = _publication(request)
    path = publication.file_path(version, name)
    if path is None or not path.is_file():
        raise NotFound(f"weights v{version} have no file {name!r} (or are no longer kept)")
    if not publication.writing(version):
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})
    # Its directory is renamed when the write completes: opened now, before anything is awaited.
    with path.open("rb") as source:
        size = os.fstat(source.fileno()).st_size
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        if request.transport is None:
            raise ConnectionResetError("the client went away")
        await asyncio.get_running_loop().sendfile(request.transport, source, 0, size)
        await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app[PUBLICATION] = _Slot()
    app.router.add_get("/admin/weights/current", current)
    app.router.add_get(r"/admin/weights/v{version:\d{1,18}}/manifest", manifest)
    app.router.add_get(r"/admin/weights/v{version:\d{1,18}}/files", files)
    app.router.add_get(r"/admin/weights/v{version:\d{1,18}}/{name}", weight_file)
