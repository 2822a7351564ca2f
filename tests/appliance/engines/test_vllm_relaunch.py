"""A vLLM server that dies on a collocated GPU is relaunched only when the GPU is the engine's.

No vLLM and no GPU: the engine's server processes are stand-ins that share one modelled GPU
with a trainer. A stand-in starts as vLLM 0.33 does (``v1/worker/utils.py``): it refuses unless
``gpu_memory_utilization`` of the GPU's *total* memory is free, whatever else holds the rest;
its HTTP routes (``/sleep``, ``/wake_up``, ...) are a real aiohttp server on port 0 that moves
the modelled memory as vLLM's sleep mode does. The engine, its supervisor and its sleep/wake
are the real ones, driven in the scheduler's order (sleep -> trainer onload -> ... -> trainer
offload -> wake weights -> wake KV cache).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from appliance.engines.vllm_engine import VLLMEngine
from contracts.errors import EngineUnavailable

GIB = 1024**3
TOTAL = 80 * GIB
UTILIZATION = 0.9
#: What the modelled processes hold: vLLM awake (its fraction) and asleep, the trainer training
#: and offloaded.
AWAKE, ASLEEP = int(UTILIZATION * TOTAL), 2 * GIB
TRAINING, OFFLOADED = 50 * GIB, 2 * GIB


@dataclass
class Gpu:
    """One GPU's memory, by holder."""

    held: dict[str, int] = field(default_factory=dict)
    #: Each launch: whether it found its fraction free.
    launches: list[bool] = field(default_factory=list)

    @property
    def free(self) -> int:
        return TOTAL - sum(self.held.values())


class StandIn:
    """A launched server as ``ServerProcess`` is to the engine: start, wait, stop."""

    def __init__(self, gpu: Gpu, base_url: str) -> None:
        self.gpu, self.base_url, self.pid = gpu, base_url, 4242
        self._exited = asyncio.Event()
        #: Set when the supervisor, having seen the exit, stops what is left of it.
        self.stopped = asyncio.Event()

    async def start(self, session: aiohttp.ClientSession, timeout_s: float) -> float:
        wanted = int(UTILIZATION * TOTAL)
        self.gpu.launches.append(self.gpu.free >= wanted)
        if self.gpu.free < wanted:
            self._exited.set()
            raise EngineUnavailable(
                f"Free memory on device ({self.gpu.free / GIB:.1f} GiB) is less than desired GPU memory "
                f"utilization ({UTILIZATION}, {wanted / GIB:.1f} GiB)"
            )
        self.gpu.held["vllm"] = AWAKE
        return 0.0

    def kill(self) -> None:
        self.gpu.held.pop("vllm", None)
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        return -9

    async def stop(self, grace_s: float = 10.0) -> None:
        self.kill()
        self.stopped.set()


@pytest_asyncio.fixture
async def gpu() -> AsyncIterator[tuple[Gpu, str]]:
    """The modelled GPU and the stand-in servers' HTTP side (vLLM's dev routes)."""
    state = Gpu()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": 2048}]})

    async def sleep(request: web.Request) -> web.Response:
        state.held["vllm"] = ASLEEP
        return web.Response()

    async def wake_up(request: web.Request) -> web.Response:
        state.held["vllm"] = AWAKE
        return web.Response()

    async def is_sleeping(request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": state.held.get("vllm") == ASLEEP})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield state, f"http://{host}:{port}"
    await runner.cleanup()


@pytest_asyncio.fixture
async def engine(gpu: tuple[Gpu, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    state, url = gpu
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    # A port (the stand-ins' HTTP side listens on TCP), not a Unix socket of the engine's own.
    engine = VLLMEngine(
        tmp_path, device="cuda", gpu_memory_utilization=UTILIZATION, port=int(url.rsplit(":", 1)[1])
    )
    servers: list[StandIn] = []

    def new_server(port: int) -> StandIn:
        servers.append(StandIn(state, url))
        return servers[-1]

    monkeypatch.setattr(engine, "_new_server", new_server)
    state.held["trainer"] = OFFLOADED  # built, then offloaded, before vLLM starts its serving
    await engine.start()
    yield engine, servers
    await engine.close()


async def test_a_server_that_died_asleep_is_relaunched_at_the_wake(engine: Any, gpu: tuple[Gpu, str]) -> None:
    """Relaunched at once, the new server would ask for 90% of the GPU while the trainer trains
    on it (vLLM: "less than desired GPU memory utilization"), fail, and fail again on every
    retry until the supervisor gave up."""
    vllm, servers = engine
    state, _ = gpu
    assert state.launches == [True]

    await vllm.sleep(1)
    state.held["trainer"] = TRAINING  # onload, train
    servers[-1].kill()  # the server dies while the trainer has the GPU
    async with asyncio.timeout(10):
        await servers[-1].stopped.wait()  # the supervisor has seen it
    await asyncio.sleep(0.2)  # time enough for a relaunch to begin, were one to
    assert state.launches == [True], "a server was launched while the trainer held the GPU"
    assert vllm.down_reason is not None and "next wake" in vllm.down_reason

    state.held["trainer"] = OFFLOADED  # offload
    async with asyncio.timeout(10):
        await vllm.wake(["weights"])
        await vllm.wake(["kv_cache"])
    assert state.launches == [True, True]
    assert vllm.down_reason is None and vllm.restarts == 1
    assert not vllm.is_sleeping and vllm.server_sleeping is False
    assert state.held == {"trainer": OFFLOADED, "vllm": AWAKE}


async def test_a_sleep_waits_for_a_relaunch_under_way(
    engine: Any, gpu: tuple[Gpu, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that died awake is relaunched at once; a switch that begins meanwhile puts the
    new server to sleep before the trainer may onload, never while it allocates."""
    vllm, servers = engine
    state, _ = gpu
    started = asyncio.Event()
    release = asyncio.Event()
    real_start = StandIn.start

    async def slow_start(self: StandIn, session: aiohttp.ClientSession, timeout_s: float) -> float:
        started.set()
        await release.wait()
        return await real_start(self, session, timeout_s)

    monkeypatch.setattr(StandIn, "start", slow_start)
    servers[-1].kill()
    async with asyncio.timeout(10):
        await started.wait()
        sleeping = asyncio.create_task(vllm.sleep(1))
        await asyncio.sleep(0.05)
        assert not sleeping.done(), "the sleep did not wait for the relaunch"
        release.set()
        await sleeping
    assert state.launches == [True, True]
    assert state.held["vllm"] == ASLEEP  # asleep before the trainer takes the GPU
    assert vllm.down_reason is None
