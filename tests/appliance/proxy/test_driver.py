"""Streamed calls through the driver: on every surface the text deltas add up to the text the
stream ends with and to the text the same answer gets unstreamed.

A property test over random answers (seeded, so every run sends the same ones): leading and
trailing whitespace, tool-call blocks that parse, that name no declared tool, that never close,
and text that only looks like the start of one. The engine's ``generate`` answers each call with
the chosen text (``fakes.FastEngine``); proxy, store and render path are real.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from tests.appliance.proxy.fakes import FastEngine
from tests.support import make_config, register_rollout, rollout_base

ANSWERS = 40
SEED = 31
TOOL: Any = {"type": "function", "name": "f", "parameters": {"type": "object"}}
CHAT_TOOL: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL: Any = {"name": "f", "input_schema": {"type": "object"}}
SPACE = ["", " ", "  ", "\n", "\n\n", " \n ", "\t"]
WORDS = ["w", "hello", "Let me check.", "a  b", "x<tool", "<tool_c", "<", "tool_call>", "café", "{}"]
BLOCKS = [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',  # a call
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',  # an undeclared tool: text
    "<tool_call>\nnot json\n</tool_call>",  # text
    '<tool_call>\n{"name": "f", ',  # never closed: text
]


def random_answer(rng: random.Random) -> str:
    words = [rng.choice(WORDS) + rng.choice(SPACE) for _ in range(rng.randrange(0, 4))]
    text = rng.choice(SPACE) + "".join(words)
    if rng.random() < 0.5:
        text += rng.choice(BLOCKS)
        if rng.random() < 0.3:
            text += rng.choice(SPACE) + rng.choice(BLOCKS)
    return text + rng.choice(SPACE)


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=64)) as appliance:
        yield appliance


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    assert response.status == 200, await response.text()
    async for line in response.content:
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            yield json.loads(line[6:])


class Surfaces:
    """One rollout's four surfaces; each method returns (streamed deltas joined, the texts the
    stream and the unstreamed response end with)."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session, self.base = session, base

    async def post(self, path: str, body: dict[str, Any], *, stream: bool) -> aiohttp.ClientResponse:
        return await self.session.post(self.base + path, json={**body, "stream": stream})

    async def chat(self) -> tuple[str, list[str]]:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [CHAT_TOOL]}
        whole = await (await self.post("/v1/chat/completions", body, stream=False)).json()
        deltas = ""
        async with await self.post("/v1/chat/completions", body, stream=True) as response:
            async for chunk in events(response):
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    deltas += choice["delta"].get("content") or ""
        return deltas, [whole["choices"][0]["message"]["content"] or ""]

    async def completions(self) -> tuple[str, list[str]]:
        body = {"model": "m", "prompt": "Hi"}
        whole = await (await self.post("/v1/completions", body, stream=False)).json()
        deltas = ""
        async with await self.post("/v1/completions", body, stream=True) as response:
            async for chunk in events(response):
                assert "error" not in chunk, chunk
                deltas += "".join(choice["text"] for choice in chunk["choices"])
        return deltas, [whole["choices"][0]["text"]]

    async def responses(self) -> tuple[str, list[str]]:
        body = {"model": "m", "input": "Hi", "tools": [TOOL], "max_output_tokens": 64}
        whole = await (await self.post("/v1/responses", body, stream=False)).json()
        deltas, done, final = "", "", ""
        async with await self.post("/v1/responses", body, stream=True) as response:
            async for event in events(response):
                kind = event["type"]
                assert kind != "error", event
                if kind == "response.output_text.delta":
                    deltas += event["delta"]
                elif kind == "response.output_text.done":
                    done = event["text"]
                elif kind == "response.completed":
                    final = message_text(event["response"])
        return deltas, [done, final, message_text(whole)]

    async def anthropic(self) -> tuple[str, list[str]]:
        body = {
            "model": "m",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [ANTHROPIC_TOOL],
        }
        whole = await (await self.post("/v1/messages", body, stream=False)).json()
        deltas = ""
        async with await self.post("/v1/messages", body, stream=True) as response:
            async for event in events(response):
                assert event["type"] != "error", event
                if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                    deltas += event["delta"]["text"]
        return deltas, ["".join(b["text"] for b in whole["content"] if b["type"] == "text")]


def message_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


async def test_streamed_deltas_add_up_to_the_final_text_on_every_surface(
    app: Appliance, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    engine = FastEngine(tokenizer)
    monkeypatch.setattr(app.engine, "generate", engine.generate)
    rng = random.Random(SEED)
    # The case first: a text answer that starts with a space, a function tool declared.
    answers = [" w is the answer.", *(random_answer(rng) for _ in range(ANSWERS))]
    timeout = aiohttp.ClientTimeout(total=60)
    for i, answer in enumerate(answers):
        assert tokenizer.decode(tokenizer.encode(answer)) == answer
        engine.say(answer)
        active = register_rollout(app, f"r{i}")
        headers = {"Authorization": f"Bearer {active.token}", "x-api-key": active.token}
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            surfaces = Surfaces(session, rollout_base(app, active))
            for surface in (surfaces.chat, surfaces.completions, surfaces.responses, surfaces.anthropic):
                deltas, finals = await surface()
                assert all(final == deltas for final in finals), (surface.__name__, answer, deltas, finals)
