"""How the vLLM engine hands a stream's tokens to its caller, against a stand-in for vLLM's server
(no vLLM needed), reached over TCP and over a Unix socket (``unix:`` URLs, as the engine reaches a
server it launches): what one read brings goes over in one ``on_tokens`` call, and a bounded batch
asks for a ``stream_interval`` only once the server's pace is known to allow it."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from appliance.engines.base import GenerateRequest, SamplingParams
from appliance.engines.vllm_engine import VLLMEngine

ANSWER = list(range(10, 50))


@pytest.fixture(params=["tcp", "unix"])
async def server(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A vLLM-shaped server that streams ``ANSWER`` at once, as vLLM 0.32 writes it (the first
    token alone, then ``stream_interval`` tokens per event), and keeps the bodies it was sent."""
    bodies: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": 2048}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        bodies.append(body)
        every = int(body.get("stream_interval") or 1)
        groups = [ANSWER[:1], *(ANSWER[i : i + every] for i in range(1, len(ANSWER), every))]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, group in enumerate(groups):
            block = {
                "tokens": [f"token_id:{t}" for t in group],
                "token_logprobs": [-0.5] * len(group),
                "top_logprobs": None,
            }
            finish = "length" if i == len(groups) - 1 else None
            event = {"choices": [{"index": 0, "text": "x", "logprobs": block, "finish_reason": finish}]}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    with tempfile.TemporaryDirectory() as directory:
        if request.param == "unix":
            path = f"{directory}/vllm.sock"
            await web.UnixSite(runner, path).start()
            yield f"unix:{path}", bodies
        else:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            host, port = runner.addresses[0][:2]
            yield f"http://{host}:{port}", bodies
        await runner.cleanup()


async def test_a_streams_reads_go_over_in_groups_and_its_pace_sizes_the_next_batch(
    server: tuple[str, list[dict[str, Any]]], tiny_model_dir: Path
) -> None:
    url, bodies = server
    engine = VLLMEngine(tiny_model_dir, base_url=url)
    await engine.start()
    try:
        groups: list[list[int]] = []
        singles: list[int] = []

        def on_tokens(ids: Sequence[int], logprobs: Sequence[float]) -> None:
            assert len(ids) == len(logprobs) and ids
            groups.append(list(ids))

        def request(**extra: Any) -> GenerateRequest:
            return GenerateRequest(
                prompt_ids=[1, 2, 3],
                params=SamplingParams(max_tokens=len(ANSWER)),
                on_token=lambda token, logprob: singles.append(token),
                **extra,
            )

        bounded = {"on_tokens": on_tokens, "token_batch": 16, "batch_wait_s": 0.02}
        first = await engine.generate(request(**bounded))
        assert list(first.token_ids) == ANSWER
        assert [t for group in groups for t in group] == ANSWER and singles == []
        # The server's pace was not known: one token per event, as a slow server would stream.
        assert "stream_interval" not in bodies[0]
        # This server sent every token at once: the next bounded batch is the whole 16.
        await engine.generate(request(**bounded))
        assert bodies[1]["stream_interval"] == 16
        # Without ``on_tokens``, each token goes to ``on_token``; an unbounded batch is its count.
        await engine.generate(request(token_batch=4))
        assert singles == ANSWER and bodies[2]["stream_interval"] == 4
    finally:
        await engine.close()
