"""A remote replica that fails under a call, through a real appliance (torch engine, tiny model,
real SQLite, the proxy's real routes, real OpenAI clients).

Lost after it streamed tokens: the call ends with an OpenAI-shaped error naming the replica, and
the rollout fails with that reason (``status --failures``) even though its agent went on and
ended well. The fleet's routing alone: ``test_fleet_remote.py``; the registration routes:
``test_remote.py``; real vLLM: ``test_vllm_remote.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.cli.status import status_report
from appliance.engines.base import Engine, GenerateRequest, GenerateResult
from appliance.engines.fleet import EngineFleet
from contracts.errors import EngineUnavailable
from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import PythonAdapter
from store.events import LLMCallRefused, RolloutFinished
from tests.support import make_config

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
