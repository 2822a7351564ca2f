"""Faults the run survives, and what the user sees of each.

* Engine failure mid-generation (torch, in process): the call gets a retryable 503 in the OpenAI
  shape, the engine serves on. For the vLLM engine (its own process): the server killed during a
  call, the call gets a 503, the supervisor restarts it and later calls succeed (``vllm`` +
  ``slow``; the engine-level test is ``test_supervisor_restarts_a_killed_server`` in
  tests/appliance/engines/test_vllm_engine.py).
* Trainer failure mid-step: ``TrainStepFailed`` is recorded, the groups stay ready and the step
  is tried again; no rollout is lost or trained twice. Failing every time stops the run with
  ``TrainingFailed`` after a few attempts.
* A step whose weights cannot be written (a full disk): the retry writes the step the trainer
  took rather than taking it again (each rollout weighs once in the weights too); a save that
  keeps failing stops the run with the step taken once; the engine never gets the weights of a
  step the log does not hold.
* Disk full: calls are answered 507 ``store_full`` with nothing half-written; when space
  returns, calls succeed and the checksum chain verifies.
* Slow client: a stream nobody reads does not hold up other rollouts' calls.

Covered elsewhere: a crashing harness is recorded as a failed rollout
(tests/harness_adapters/test_contract.py), a client that disconnects mid-stream cancels its
generation and the call is recorded as cancelled
(``test_client_disconnect_mid_stream_cancels_and_is_recorded`` in
tests/appliance/proxy/test_openai_chat.py), SIGKILL at random points
(tests/appliance/test_crash_consistency.py).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import openai
import pytest
import torch

from appliance.app import Appliance
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.engines.factory import vllm_python
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.vllm_engine import VLLMEngine
from appliance.scheduler.switch import MAX_TRAIN_FAILURES
from appliance.training.service import _Taken
from contracts.errors import TrainingFailed
from store.events import TrainStepCompleted, TrainStepFailed
from tests.support import local_engine, make_config, openai_client, recorded_calls, register_rollout
from trainer.items import StepOutput

USER: list[Any] = [{"role": "user", "content": "What is 3 + 4?"}]
STORY: list[Any] = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=8, max_steps=2)) as appliance:
        yield appliance


def error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    return dict(body["error"])


def assert_retryable_503(exc: openai.APIStatusError, message: str) -> None:
    assert exc.status_code == 503
    assert exc.response.headers["Retry-After"] == "1"
    error = error_body(exc)
    assert error["code"] == "engine_unavailable"
    assert message in error["message"]


async def test_an_engine_failure_mid_generation_is_a_retryable_503(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = local_engine(app)
    assert isinstance(engine, TorchEngine)
    real_step = engine._step
    failures: list[int] = []

    def failing_step(batch: Any) -> Any:  # the first decode step after the prefill fails once
        if not failures:
            failures.append(1)
            raise RuntimeError("injected: device-side assert triggered")
        return real_step(batch)

    monkeypatch.setattr(engine, "_step", failing_step)
    active = register_rollout(app)
    async with openai_client(app, active) as oai:
        with pytest.raises(openai.APIStatusError) as caught:
            await oai.chat.completions.create(model="m", messages=USER, max_tokens=8)
        assert_retryable_503(caught.value, "injected: device-side assert")
        again = await oai.chat.completions.create(model="m", messages=USER, max_tokens=8)
    assert failures == [1]
    assert [c.call_id for c in await recorded_calls(app)] == [again.id.removeprefix("chatcmpl-")]


async def test_an_engine_that_raises_outside_its_contract_fails_that_call_retryably(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an ``EngineUnavailable``: a bug or a broken engine. Still only that call fails, with a
    retryable 503 instead of a 500, and the next call is served."""
    real_generate = app.engine.generate
    raised: list[int] = []

    async def generate(request: GenerateRequest) -> GenerateResult:
        if not raised:
            raised.append(1)
            raise RuntimeError("injected: the engine broke")
        return await real_generate(request)

    monkeypatch.setattr(app.engine, "generate", generate)
    active = register_rollout(app)
    async with openai_client(app, active) as oai:
        with pytest.raises(openai.APIStatusError) as caught:
            await oai.chat.completions.create(model="m", messages=USER, max_tokens=8)
        assert_retryable_503(caught.value, "RuntimeError: injected: the engine broke")
        again = await oai.chat.completions.create(model="m", messages=USER, max_tokens=8)
    assert again.choices[0].message is not None
    assert app.runner is not None and app.runner.gate.inflight == 0


async def test_a_trainer_failure_mid_step_is_retried_and_trains_each_rollout_once(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = app.training.trainer
    real_step = trainer.step
    attempts: list[int] = []

    def failing_once(items: Any) -> Any:
        attempts.append(len(items))
        if len(attempts) == 1:
            raise RuntimeError("injected: CUDA out of memory")
        return real_step(items)

    monkeypatch.setattr(trainer, "step", failing_once)
    assert await app.run() == "reached step 2"
    events = [s.event for s in await app.store.read()]
    (failed,) = [e for e in events if isinstance(e, TrainStepFailed)]
    assert (failed.step, failed.attempt) == (1, 1)
    assert "RuntimeError: injected: CUDA out of memory" in failed.error
    steps = [e for e in events if isinstance(e, TrainStepCompleted)]
    assert [s.step for s in steps] == [1, 2]
    trained = [r for s in steps for r in s.rollouts]
    assert len(trained) == len(set(trained)) == 2 * 2 * 2  # steps x groups x group size
    # The failed step's groups were trained by the retry, not dropped.
    assert set(failed.groups) == {app.live.state.rollouts[r].group for r in steps[0].rollouts}
    assert len(attempts) == 3


def adam_steps(app: Appliance) -> set[int]:
    """The update counts the trainer's optimizer holds for its parameters (empty before one)."""
    optimizer = app.training.trainer.optimizer  # type: ignore[attr-defined]
    return {int(state["step"]) for state in optimizer.state.values()}


def count_steps(app: Appliance, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each step the trainer takes from now on updates its weights, in order."""
    trainer = app.training.trainer
    real_step = trainer.step
    updated: list[bool] = []

    def counted(items: Any) -> Any:
        output = real_step(items)
        updated.append(output.updated)
        return output

    monkeypatch.setattr(trainer, "step", counted)
    return updated


async def test_a_step_whose_weights_could_not_be_written_is_written_again_not_taken_again(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = app.training.trainer
    updated = count_steps(app, monkeypatch)
    real_save = trainer.save
    saves: list[int] = []

    def full_disk_once(store: Any, version: int) -> Any:
        saves.append(version)
        if len(saves) == 1:  # the trainer has taken step 1; its weights cannot be written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(store, version)

    monkeypatch.setattr(trainer, "save", full_disk_once)
    assert await app.run() == "reached step 2"
    events = [s.event for s in await app.store.read()]
    (failed,) = [e for e in events if isinstance(e, TrainStepFailed)]
    assert failed.step == 1 and "No space left on device" in failed.error
    assert [s.step for s in events if isinstance(s, TrainStepCompleted)] == [1, 2]
    # The retry wrote the step the trainer had taken: two steps in the log, two in the weights.
    assert len(updated) == 2 and saves[:3] == [1, 1, 2]
    assert adam_steps(app) == ({sum(updated)} if any(updated) else set())


async def test_a_save_that_keeps_failing_stops_the_run_with_the_step_taken_once(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    updated = count_steps(app, monkeypatch)

    def full_disk(store: Any, version: int) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app.training.trainer, "save", full_disk)
    with pytest.raises(TrainingFailed, match=r"step 1 failed 3 times in a row.*No space left") as failed:
        await app.run()
    assert f"the disk of {app.training.run_dir} is full: " in failed.value.message
    assert failed.value.message.endswith("free space on that disk and start it again")
    events = [s.event for s in await app.store.read()]
    assert [e.attempt for e in events if isinstance(e, TrainStepFailed)] == [1, 2, 3]
    assert not [e for e in events if isinstance(e, TrainStepCompleted)]
    assert len(updated) == 1  # each attempt wrote the same step again


async def test_a_step_not_made_durable_at_version_0_stops_a_run_whose_engine_dropped_its_weights(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sleep level 2 drops the engine's weights at each switch; after a failed first step the
    trainer holds weights no version names, and an in-process trainer cannot load the model's
    own again: the run stops saying so, rather than serving them."""
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=2, sleep_level=2)) as app:

        def full_disk(store: Any, version: int) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(app.training.trainer, "save", full_disk)
        with pytest.raises(TrainingFailed, match=r"start the appliance again .*resumes at version 0"):
            await app.run()
        assert app.engine.policy_version == 0
        events = [s.event for s in await app.store.read()]
        assert [e.attempt for e in events if isinstance(e, TrainStepFailed)] == [1]


async def test_weights_of_a_step_not_made_durable_never_reach_the_engine(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=1)) as app:
        assert await app.run() == "reached step 1"
        training, trainer = app.training, app.training.trainer
        published = {k: v.clone() for k, v in trainer.state_dict_for_engine().items()}
        # A step the trainer took on other groups whose files could not be written.
        with torch.no_grad():
            for parameter in trainer.model.parameters():  # type: ignore[attr-defined]
                parameter.add_(0.5)
        training._undurable = _Taken(frozenset({"other"}), 1, cast(StepOutput, None))
        await training.push(1)  # what a switch does after a failed step (sleep level 2)
        assert training._undurable is None
        back = trainer.state_dict_for_engine()
        assert all(torch.equal(back[k], v) for k, v in published.items())
        served = local_engine(app)._model.state_dict()
        common = served.keys() & published.keys()
        assert common and all(torch.equal(served[k], published[k]) for k in common)


async def test_a_trainer_failing_every_time_stops_the_run_with_its_reason(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    def always_failing(items: Any) -> Any:
        raise ValueError("injected: NaN loss")

    monkeypatch.setattr(app.training.trainer, "step", always_failing)
    with pytest.raises(TrainingFailed, match=r"step 1 failed 3 times in a row.*NaN loss"):
        await app.run()
    events = [s.event for s in await app.store.read()]
    failed = [e for e in events if isinstance(e, TrainStepFailed)]
    assert [e.attempt for e in failed] == list(range(1, MAX_TRAIN_FAILURES + 1))
    assert not [e for e in events if isinstance(e, TrainStepCompleted)]


async def test_a_full_disk_answers_507_and_recovers_when_space_returns(app: Appliance) -> None:
    active = register_rollout(app)
    acknowledged: list[str] = []
    async with openai_client(app, active) as oai:
        await app.store.set_max_bytes(0)  # hold the file at its current size: it fills up
        with pytest.raises(openai.APIStatusError) as caught:
            for _ in range(50):
                answer = await oai.chat.completions.create(model="m", messages=USER, max_tokens=8)
                acknowledged.append(answer.id.removeprefix("chatcmpl-"))
        assert caught.value.status_code == 507
        error = error_body(caught.value)
        assert error["code"] == "store_full"
        assert "full; free space" in error["message"]

        await app.store.set_max_bytes(None)  # space returns
        answer = await oai.chat.completions.create(model="m", messages=USER, max_tokens=8)
        acknowledged.append(answer.id.removeprefix("chatcmpl-"))
    assert [c.call_id for c in await recorded_calls(app)] == acknowledged
    report = await app.store.verify()
    assert report.events == app.store.last_position


async def open_unread_stream(
    app: Appliance, rollout: str, token: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streamed call from a client that reads the headers, then stops reading (tiny buffers)."""
    url = urlsplit(app.proxy_url)
    assert url.hostname is not None and url.port is not None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (url.hostname, url.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    # Top log-probabilities make each event ~2 KB: the stream outgrows the socket buffers and the
    # transport's high-water mark, so the proxy's writes for it wait on the client.
    request = {"model": "m", "messages": USER, "stream": True, "max_tokens": 1500}
    body = json.dumps({**request, "logprobs": True, "top_logprobs": 20}).encode()
    writer.write(
        f"POST /rollouts/{rollout}/v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    status = await reader.readline()
    assert b" 200 " in status, status
    while await reader.readline() not in (b"\r\n", b""):
        pass  # headers
    return reader, writer  # the caller keeps the writer: collecting it would close the connection


async def test_a_slow_reader_does_not_hold_up_other_rollouts(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_tokens=8, max_tokens_cap=1500)
    async with Appliance(config) as app:
        slow, other = register_rollout(app, "slow"), register_rollout(app, "other")
        reader, writer = await open_unread_stream(app, slow.rollout, slow.token)
        async with openai_client(app, other) as oai, asyncio.timeout(120):  # a hang fails, not slowness
            answers = [
                await oai.chat.completions.create(model="m", messages=USER, max_tokens=8) for _ in range(3)
            ]
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        others = [c for c in await recorded_calls(app) if c.rollout == "other"]
        assert len(others) == 3
        async with asyncio.timeout(120):  # now read the slow stream: whole and in order
            rest = await reader.read()
        writer.close()
        assert b"data: [DONE]" in rest
        async with asyncio.timeout(30):
            while not [c for c in await recorded_calls(app) if c.rollout == "slow"]:
                await app.live.wait_change(app.live.position)
        (call,) = [c for c in await recorded_calls(app) if c.rollout == "slow"]
        assert call.finish_reason in ("stop", "length")


VLLM_PYTHON = vllm_python(Path(".venv-vllm/bin/python")).absolute()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM's virtualenv is missing ({VLLM_PYTHON})")
async def test_a_killed_vllm_server_is_a_503_then_restarted(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(
        tmp_path, tiny_model_dir, engine="vllm", vllm_python=VLLM_PYTHON, max_tokens=8, max_tokens_cap=1500
    )
    async with Appliance(config) as app:
        engine = app.engine
        assert isinstance(engine, VLLMEngine) and engine.server_pid is not None
        active = register_rollout(app)
        async with openai_client(app, active) as oai:
            await oai.chat.completions.create(model="m", messages=USER, max_tokens=4)
            # Greedy, this prompt runs for ~800 tokens on the tiny model: the kill lands mid-way.
            stream = await oai.chat.completions.create(
                model="m", messages=STORY, max_tokens=1500, temperature=0, stream=True
            )
            killed = False
            with pytest.raises(openai.APIError) as in_flight:
                async for _chunk in stream:
                    if not killed:  # the first token arrived: generation is under way
                        os.kill(engine.server_pid, signal.SIGKILL)
                        killed = True
            assert isinstance(in_flight.value.body, dict)
            assert in_flight.value.body["code"] == "engine_unavailable"
            with pytest.raises(openai.APIStatusError) as caught:  # while the server restarts
                await oai.chat.completions.create(model="m", messages=USER, max_tokens=4)
            assert caught.value.status_code == 503
            assert error_body(caught.value)["code"] == "engine_unavailable"
            async with asyncio.timeout(540):
                while True:  # what a client does with a 503: retry until it serves again
                    try:
                        again = await oai.chat.completions.create(model="m", messages=USER, max_tokens=4)
                        break
                    except openai.APIStatusError as exc:
                        assert exc.status_code == 503
                        await asyncio.sleep(0.5)
        assert engine.restarts == 1
        assert (await recorded_calls(app))[-1].call_id == again.id.removeprefix("chatcmpl-")
