"""Remote replicas in a real appliance (torch engine, tiny model, real SQLite, the proxy's real
routes) against vLLM-shaped servers on port 0: ``/admin/engines`` (the admin token; a server
serving another model refused in one line; registered, listed, removed), the replica events
folded and replayed from the store, and a restart that re-attaches the replicas the log holds
(or records them lost). The fleet's routing: ``test_fleet_remote.py``; real vLLM servers:
``test_vllm_remote.py``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from appliance.app import Appliance
from appliance.engines.remote import replica_id
from appliance.engines.remote_check import checkpoint_shapes, differences
from store.events import EngineCaughtUp, EngineLost, EngineRegistered, Event
from store.eventstore import EventStore
from store.projections import RunState
from tests.support import make_config


@contextlib.asynccontextmanager
async def vllm_shaped(shapes: dict[str, tuple[int, ...]], max_model_len: int = 1 << 20) -> AsyncIterator[str]:
    """A server answering what a replica is asked at registration (``/v1/models``, the worker
    extension's fingerprint, ``/health``) for a model of ``shapes``; its URL."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": max_model_len}]})

    async def rpc(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["method"] == "appliance_model_fingerprint"
        fingerprint = {"shapes": {k: list(v) for k, v in shapes.items()}, "dtype": "float32"}
        return web.json_response({"results": [fingerprint]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/collective_rpc", rpc)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def admin(
    app: Appliance, method: str, path: str, body: Any = None, token: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {app.admin_token if token is None else token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"{app.proxy_url}{path}", json=body, headers=headers) as response,
    ):
        return response.status, await response.json()


async def events_of(app: Appliance, kind: type[Event]) -> list[Any]:
    return [s.event for s in await app.store.read(0, types={kind.type})]


async def test_engines_routes_register_refuse_list_and_remove(tmp_path: Path, tiny_model_dir: Path) -> None:
    shapes = checkpoint_shapes(tiny_model_dir)
    other = {**shapes, "model.embed_tokens.weight": (999, 64)}
    other.pop("model.layers.1.mlp.up_proj.weight")
    async with (
        vllm_shaped(shapes) as url,
        vllm_shaped(other) as wrong,
        Appliance(make_config(tmp_path, tiny_model_dir)) as app,
    ):
        assert (await admin(app, "GET", "/admin/engines", token="wrong"))[0] == 401
        status, body = await admin(app, "POST", "/admin/engines", {"url": url}, token="")
        assert status == 401 and body["error"]["type"]

        status, body = await admin(app, "POST", "/admin/engines", {"url": wrong})
        assert status == 400 and body["error"]["param"] == "url"
        message = body["error"]["message"]
        assert "\n" not in message and message.startswith(f"the engine at {wrong} serves another model")
        assert "model.embed_tokens.weight is [999, 64] there" in message
        status, body = await admin(app, "POST", "/admin/engines", {"url": "ftp://nowhere"})
        assert status == 400 and "http://host:port" in body["error"]["message"]
        assert await events_of(app, EngineRegistered) == []

        status, body = await admin(app, "POST", "/admin/engines", {"url": url + "/"})
        rid = replica_id(url)
        assert status == 201 and body["id"] == rid and body["url"] == url
        assert body["remote"] and body["state"] == "behind"  # it takes the run's version first
        assert body["weights"] == "http"  # it pulls each version from the appliance (the default)
        (registered,) = await events_of(app, EngineRegistered)
        assert (registered.replica, registered.url, registered.max_model_len) == (rid, url, 1 << 20)
        assert registered.weights == "http"
        status, again = await admin(app, "POST", "/admin/engines", {"url": url})
        assert status == 200 and again["id"] == rid
        status, listing = await admin(app, "GET", "/admin/engines")
        assert [(e["id"], e["remote"]) for e in listing["engines"]] == [("0", False), (rid, True)]

        status, body = await admin(app, "DELETE", "/admin/engines/0")
        assert status == 409 and "launched by the appliance" in body["error"]["message"]
        assert (await admin(app, "DELETE", "/admin/engines/nope"))[0] == 404
        status, body = await admin(app, "DELETE", f"/admin/engines/{rid}")
        assert status == 200 and body["removed"]
        (lost,) = await events_of(app, EngineLost)
        assert lost.replica == rid and lost.removed
        assert [e["id"] for e in (await admin(app, "GET", "/admin/engines"))[1]["engines"]] == ["0"]


async def test_a_restart_re_attaches_registered_replicas_and_records_the_missing_lost(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    shapes = checkpoint_shapes(tiny_model_dir)
    config = make_config(tmp_path, tiny_model_dir)
    async with vllm_shaped(shapes) as url_a:
        async with vllm_shaped(shapes) as url_b:
            async with Appliance(config) as app:
                for url in (url_a, url_b):
                    assert (await admin(app, "POST", "/admin/engines", {"url": url}))[0] == 201
            # Back with both answering: both attached again, nothing recorded anew.
            async with Appliance(config) as app:
                listing = (await admin(app, "GET", "/admin/engines"))[1]["engines"]
                assert [e["url"] for e in listing if e["remote"]] == [url_a, url_b]
                assert len(await events_of(app, EngineRegistered)) == 4  # re-checked at each start
        # Server b is gone: a start records it lost, serves with the rest, and lists it so.
        async with Appliance(config) as app:
            listing = (await admin(app, "GET", "/admin/engines"))[1]["engines"]
            states = {e["url"]: e["state"] for e in listing if e["remote"]}
            # a holds the run's version (0: the checkpoint, nothing published to pull): live.
            assert states[url_a] == "live" and states[url_b] == "lost"
            (lost,) = await events_of(app, EngineLost)
            assert lost.replica == replica_id(url_b) and not lost.removed and url_b in lost.reason
            assert app.live.state.replicas[replica_id(url_b)].state == "lost"


async def test_replica_events_fold_and_replay_from_the_store(tmp_path: Path) -> None:
    store = await EventStore.open(tmp_path / "events.sqlite")
    try:
        await store.append(
            [
                EngineRegistered(ts=1.0, replica="ra", url="http://a:8000", model="tiny", max_model_len=2048),
                EngineRegistered(ts=2.0, replica="rb", url="http://b:8000", model="tiny", policy_version=3),
                EngineCaughtUp(ts=3.0, replica="ra", policy_version=4),
                EngineLost(ts=4.0, replica="rb", reason="connection refused\nat /health"),
                EngineRegistered(ts=5.0, replica="rc", url="http://c:8000", model="tiny"),
                EngineLost(ts=6.0, replica="rc", reason="removed by an operator", removed=True),
            ]
        )
    finally:
        await store.close()
    store = await EventStore.open(tmp_path / "events.sqlite")
    try:
        state = RunState.from_events(await store.read(0))
    finally:
        await store.close()
    assert list(state.replicas) == ["ra", "rb"]  # rc was removed: not re-attached
    ra, rb = state.replicas["ra"], state.replicas["rb"]
    assert (ra.url, ra.state, ra.policy_version) == ("http://a:8000", "caught up", 4)
    assert (rb.state, rb.policy_version, rb.reason) == ("lost", 3, "connection refused: at /health")
    # Registered again after it was lost: registered (and last) again.
    state.apply(EngineRegistered(ts=7.0, replica="rb", url="http://b:8000", model="tiny"))
    assert state.replicas["rb"].state == "registered" and list(state.replicas) == ["ra", "rb"]


def test_differences_name_each_weight_that_differs() -> None:
    ours = {"a.weight": (4, 2), "lm_head.weight": (10, 2), "b.weight": (3,)}
    assert differences({"a.weight": (4, 2), "b.weight": (3,)}, ours) == []  # a tied head may be missing
    assert differences({"a.weight": (4, 3), "c.weight": (1,)}, ours) == [
        "a.weight is [4, 3] there, [4, 2] here",
        "it has no b.weight",
        "it has c.weight, which the run's model has not",
    ]


def test_remote_replicas_pull_from_the_proxy_or_weights_url_unless_told_shm(tmp_path: Path) -> None:
    import socket

    from appliance.config import load_config
    from appliance.engines.remote import pull_source

    def config(**env: str) -> Any:
        return load_config(env={"APPLIANCE_DATA_DIR": str(tmp_path), **env}, resolved=False)

    publication, source = pull_source(config(), lambda: "http://127.0.0.1:8640", "secret")
    assert publication is not None and source is not None
    assert publication.root == tmp_path / "weights" and (tmp_path / "weights").stat().st_mode & 0o077 == 0
    made = source()
    assert (made.url, made.token, made.publication) == ("http://127.0.0.1:8640", "secret", publication)
    # A proxy listening on every address is reached by this machine's name.
    _, source = pull_source(config(), lambda: "http://0.0.0.0:8640", "secret")
    assert source is not None and source().url == f"http://{socket.getfqdn()}:8640"
    _, source = pull_source(config(APPLIANCE_WEIGHTS_URL="http://10.0.0.1:8640/"), lambda: "x", "t")
    assert source is not None and source().url == "http://10.0.0.1:8640"
    assert pull_source(config(APPLIANCE_REMOTE_WEIGHTS="shm"), lambda: "x", "t") == (None, None)
