"""A remote replica that fails under a call, through a real appliance (torch engine, tiny model,
real SQLite, the proxy's real routes, real OpenAI clients).

Lost after it streamed tokens: the call ends with an OpenAI-shaped error naming the replica, and
the rollout fails with that reason (``status --failures``) even though its agent went on and
ended well. Cut off without a reset (a real server that accepts and never answers): a call
that waits past ``remote_stall_s`` for a token, or whose replica misses a ``/health`` probe, is
ended there: served by the local replica when no token came, else failed naming the replica.

The fleet's routing alone: ``test_fleet_remote.py``; the registration routes: ``test_remote.py``;
real vLLM: ``test_vllm_remote.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.cli.status import status_report
from appliance.engines import remote
from appliance.engines.base import Engine, GenerateRequest, GenerateResult
from appliance.engines.fleet import EngineFleet
from appliance.engines.remote_check import checkpoint_shapes
from contracts.errors import EngineUnavailable
from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import PythonAdapter
from store.events import LLMCallRefused, RolloutFinished
from tests.appliance.engines.test_remote import admin
from tests.support import make_config, openai_client, register_rollout

URL = "http://engine-b:8000"


class DiesMidStream:
    """A remote replica's engine at the edge: it hands over three tokens of every call, then its
    connection breaks (as a vLLM server killed mid-stream does). Everything else is the local
    engine's (the same weights and version), so it joins caught up."""

    def __init__(self, local: Engine) -> None:
        self.local = local
        self.broke: list[str | None] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def pull_current(self) -> None:
        pass  # its catch-up: it holds the fleet's version already

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        assert request.on_tokens is not None
        ids: Sequence[int] = (5, 6, 7)
        request.on_tokens(ids, [-0.5] * len(ids))
        self.broke.append(request.affinity)
        await asyncio.sleep(0)
        raise EngineUnavailable(f"the vLLM server at {URL} broke off /v1/completions: connection reset")


async def agent(task: Task, client: ClientConfig) -> float:
    """Streams one answer (broken off where the replica dies), then asks again and ends well."""
    errors = []
    async with AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as oai:
        messages: Any = [{"role": "user", "content": "What is 1 + 1?"}]
        try:
            stream = await oai.chat.completions.create(
                model=client.model, messages=messages, max_tokens=8, stream=True
            )
            async for _ in stream:
                pass
        except openai.APIError as error:
            errors.append(error)
        await oai.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
    ERRORS[client.rollout_id] = errors
    return 1.0


ERRORS: dict[str, list[openai.APIError]] = {}


async def finished(app: Appliance, count: int) -> dict[str, RolloutFinished]:
    for _ in range(600):
        ends = [s.event for s in await app.store.read(0, types={RolloutFinished.type})]
        if len(ends) >= count:
            return {e.rollout: e for e in ends if isinstance(e, RolloutFinished)}
        await asyncio.sleep(0.05)
    raise AssertionError("the rollouts did not end")


async def test_a_replica_lost_after_it_streamed_tokens_fails_the_rollout_naming_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    ERRORS.clear()
    config = make_config(tmp_path, tiny_model_dir, breaker_failures=0)
    async with Appliance(config, adapter=PythonAdapter(agent)) as app:
        fleet = app.engine
        assert isinstance(fleet, EngineFleet)
        edge = DiesMidStream(fleet.replicas[0])
        fleet.add(edge, replica_id="rB", url=URL)
        for _ in range(100):
            if dict((s.id, s.state) for s in fleet.status())["rB"] == "live":
                break
            await asyncio.sleep(0.02)
        await app.controller.start_group(2)  # one rollout each: "0" first, then the least loaded
        ends = await finished(app, 2)
        refused = [s.event for s in await app.store.read(0, types={LLMCallRefused.type})]

    assert edge.broke == ["g000000-r1"]
    lost, fine = ends["g000000-r1"], ends["g000000-r0"]
    assert fine.status == "finished" and ERRORS["g000000-r0"] == []
    (error,) = ERRORS["g000000-r1"]  # OpenAI-shaped, in the stream, naming the replica
    assert error.code == "engine_replica_lost"
    assert error.message.startswith(f"engine replica rB ({URL}) was lost mid-call, after it sampled 3 tokens")
    assert lost.status == "failed"
    assert lost.error.startswith(f"engine replica rB ({URL}) was lost mid-call, after it sampled 3 tokens")
    assert "connection reset" in lost.error
    (event,) = refused
    assert isinstance(event, LLMCallRefused)
    assert (event.rollout, event.status, event.code) == (
        "g000000-r1",
        200,
        "engine_replica_lost",
    )  # streamed: 200 sent
    (failure,) = status_report(config.data_dir, failures=5)["failures"]
    assert failure["rollout"] == "g000000-r1" and failure["reason"].startswith("engine replica rB (")


class CutOff:
    """A vLLM-shaped server on port 0 (``url``) for the tiny model: it answers registration and
    ``/health`` until ``cut``, then accepts every request and never answers. Each completion
    streams ``tokens`` tokens, then never another (``asked`` counts them)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], tokens: int = 0) -> None:
        self.shapes, self.tokens = shapes, tokens
        self.cut = False
        self.asked = 0
        self.reached = asyncio.Event()  # a completion came
        self.url = ""
        self._release = asyncio.Event()  # set on the way out, so the handlers end

    async def _hang_if_cut(self) -> None:
        if self.cut:
            await self._release.wait()

    async def models(self, request: web.Request) -> web.Response:
        await self._hang_if_cut()
        return web.json_response({"data": [{"id": "policy", "max_model_len": 2048}]})

    async def rpc(self, request: web.Request) -> web.Response:
        await self._hang_if_cut()
        fingerprint = {"shapes": {k: list(v) for k, v in self.shapes.items()}, "dtype": "float32"}
        return web.json_response({"results": [fingerprint]})

    async def health(self, request: web.Request) -> web.Response:
        await self._hang_if_cut()
        return web.Response()

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.asked += 1
        self.reached.set()
        await self._hang_if_cut()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in range(5, 5 + self.tokens):
            block = {"tokens": [f"token_id:{token}"], "token_logprobs": [-0.5]}
            chunk = {"choices": [{"logprobs": block, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await self._release.wait()
        return response

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/collective_rpc", self.rpc)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.complete)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            self.url = f"http://127.0.0.1:{next(a[1] for a in runner.addresses if isinstance(a, tuple))}"
            yield self.url
        finally:
            self._release.set()
            await runner.cleanup()


@contextlib.asynccontextmanager
async def with_edge(
    tmp_path: Path, model_dir: Path, edge: CutOff, **config: object
) -> AsyncIterator[Appliance]:
    """A running appliance with ``edge`` registered, caught up and live."""
    async with edge.serving() as url, Appliance(make_config(tmp_path, model_dir, **config)) as app:
        status, body = await admin(app, "POST", "/admin/engines", {"url": url})
        assert status == 201, body
        for _ in range(200):
            if (await admin(app, "GET", "/admin/engines"))[1]["engines"][1]["state"] == "live":
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the edge replica did not catch up")
        yield app


def pin(app: Appliance, rollout: str, replica: str) -> None:
    """Route ``rollout``'s calls to ``replica``."""
    fleet = app.engine
    assert isinstance(fleet, EngineFleet)
    fleet._assign(rollout, fleet._find(replica))


async def test_a_call_stalled_before_its_first_token_is_served_by_another_replica(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    edge = CutOff(checkpoint_shapes(tiny_model_dir))
    async with with_edge(tmp_path, tiny_model_dir, edge, remote_stall_s=1.0) as app:
        active = register_rollout(app)
        pin(app, active.rollout, remote.replica_id(edge.url))
        edge.cut = True  # no reset, no answer: only a bound ends the call
        started = time.monotonic()
        async with openai_client(app, active) as client:
            answer = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        elapsed = time.monotonic() - started
        fleet = app.engine
        assert isinstance(fleet, EngineFleet)
        assert answer.choices[0].message is not None and edge.asked == 1
        assert fleet.replica_of(active.rollout) == 0  # served by the local replica
        assert 1.0 <= elapsed < 4.0  # the bound, not the health watch (5 s apart, 5 s each)


async def test_a_call_stalled_after_tokens_fails_naming_the_replica(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    edge = CutOff(checkpoint_shapes(tiny_model_dir), tokens=2)
    async with with_edge(tmp_path, tiny_model_dir, edge, remote_stall_s=1.0) as app:
        active = register_rollout(app)
        rid = remote.replica_id(edge.url)
        pin(app, active.rollout, rid)
        started = time.monotonic()
        async with openai_client(app, active) as client:
            with pytest.raises(openai.APIError) as caught:
                stream = await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
                )
                async for _ in stream:
                    pass
        assert time.monotonic() - started < 4.0
        assert caught.value.code == "engine_replica_lost"
        assert caught.value.message.startswith(
            f"engine replica {rid} ({edge.url}) was lost mid-call, after it sampled 2 tokens of this call: "
            "it handed over no token for 1 s (remote_stall_s)"
        )
        assert active.lost.startswith(f"engine replica {rid} ({edge.url}) was lost mid-call")


async def test_a_call_on_a_replica_that_misses_its_health_probe_is_ended_there(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "HEALTH_TIMEOUT_S", 0.5)
    edge = CutOff(checkpoint_shapes(tiny_model_dir))
    async with with_edge(tmp_path, tiny_model_dir, edge) as app:  # remote_stall_s: 30 s
        active = register_rollout(app)
        pin(app, active.rollout, remote.replica_id(edge.url))
        edge.cut = True
        started = time.monotonic()
        async with openai_client(app, active) as client:
            call = asyncio.ensure_future(
                client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                )
            )
            await edge.reached.wait()
            await app.replicas._watch_once()  # one round of the health watch: its probe times out
            answer = await asyncio.wait_for(call, 5.0)
        assert answer.choices[0].message is not None
        assert time.monotonic() - started < 4.0
        fleet = app.engine
        assert isinstance(fleet, EngineFleet)
        assert fleet.replica_of(active.rollout) == 0
