"""Streamed text deltas: tokens handed over in groups make the same text as token by token, the
first token is not held back, and a proxy stream whose engine hands tokens over in groups sends
grouped deltas that concatenate to what is recorded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.chat.tokenizer import IncrementalDecoder, Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.proxy.deltas import TextDeltas, TokenArrivals, stream_safe
from appliance.rollouts.registry import ActiveRollout
from tests.support import make_config, recorded_calls, register_rollout

#: Characters of one, two, three and four UTF-8 bytes, which byte-level tokens split.
TEXT = "Hello wörld — 3 + 4 = 7 🙂, ünd so weiter. Done"


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def per_token(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tokenizer)
    return [delta for token in ids if (delta := decoder.push(token))]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64])
def test_groups_decode_to_the_text_of_token_by_token(tokenizer: Tokenizer, size: int) -> None:
    ids = tokenizer.encode(TEXT)
    deltas = TextDeltas(tokenizer, (tokenizer.im_end_id,), ())
    grouped = [deltas.push(ids[i : i + size]) for i in range(0, len(ids), size)]
    grouped.append(deltas.push([tokenizer.im_end_id]))  # a stop token adds nothing
    assert "".join(grouped) == "".join(per_token(tokenizer, ids)) == TEXT
    assert deltas.text == TEXT and deltas.sent == len(TEXT)
    assert "\ufffd" not in "".join(grouped)
    assert len([d for d in grouped if d]) <= -(-len(ids) // size)


def test_a_group_ending_inside_a_character_sends_the_whole_characters_before_it(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("ok 🙂")
    for cut in range(1, len(ids)):
        if "\ufffd" in tokenizer.decode(ids[:cut]):
            break
    else:
        pytest.skip("the tokenizer writes the emoji as whole tokens")
    deltas = TextDeltas(tokenizer, (), ())
    first = deltas.push(ids[:cut])
    assert first == "ok" or first == "ok "  # what the tokens before the broken character hold
    assert first + deltas.push(ids[cut:]) == "ok 🙂"


def test_markers_hold_back_what_may_start_one(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the answer is 7 STOP and more")
    deltas = TextDeltas(tokenizer, (), ("STOP",))
    sent = "".join(deltas.push(ids[i : i + 2]) for i in range(0, len(ids), 2))
    assert sent == stream_safe(deltas.text, ("STOP",)) == "the answer is 7 "


async def test_arrivals_hand_over_everything_that_came_and_never_wait_for_more() -> None:
    arrivals = TokenArrivals()
    arrivals.add([1])
    assert await arrivals.take() == [1]  # taken at once: nothing waits for a second token
    arrivals.add([2, 3])
    arrivals.add((4,))
    assert await arrivals.take() == [2, 3, 4]
    waiting = asyncio.ensure_future(arrivals.take())
    await asyncio.sleep(0)
    assert not waiting.done()
    arrivals.add([5])
    assert await waiting == [5]
    arrivals.add([6])
    arrivals.end()
    assert await arrivals.take() == [6]
    assert await arrivals.take() is None


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_tokens=64)) as appliance:
        yield appliance


async def stream_chat(
    app: Appliance, active: ActiveRollout, on_delta: Callable[[str], None] = lambda _: None
) -> list[str]:
    """The content deltas of a streamed chat completion, read off the wire as they come."""
    deltas: list[str] = []
    body = {"model": "m", "messages": [{"role": "user", "content": "Say it."}], "stream": True}
    async with (
        asyncio.timeout(30),
        aiohttp.ClientSession() as http,
        http.post(
            f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {active.token}"},
        ) as response,
    ):
        assert response.status == 200
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                if content := choice["delta"].get("content"):
                    deltas.append(content)
                    on_delta(content)
    return deltas


@pytest.mark.parametrize("grouped", [True, False])
async def test_grouped_tokens_stream_as_fewer_deltas_of_the_same_text(app: Appliance, grouped: bool) -> None:
    """An engine that hands the first token alone and then the rest at once (vLLM's stream read
    by a proxy slower than the engine) makes two deltas, the first sent before the rest is
    sampled; token by token, one delta per token. Either way the deltas are the recorded text
    and the recorded tokens are the sampled ones."""
    tokenizer = app.registry._tokenizer
    ids = (*tokenizer.encode(TEXT), tokenizer.im_end_id)
    logprobs = (-0.5,) * len(ids)
    first_delta = asyncio.Event()

    async def generate(request: GenerateRequest) -> GenerateResult:
        assert request.on_token is not None
        if grouped and request.on_tokens is not None:
            request.on_tokens(ids[:1], logprobs[:1])
            # The rest is sampled only once the client has the first token's text.
            await asyncio.wait_for(first_delta.wait(), 10)
            request.on_tokens(ids[1:], logprobs[1:])
        else:
            for token, logprob in zip(ids, logprobs, strict=True):
                request.on_token(token, logprob)
                await asyncio.sleep(0.002)
        return GenerateResult(token_ids=ids, logprobs=logprobs, finish_reason="stop", policy_version=0)

    app.engine.generate = generate  # type: ignore[method-assign]
    active = register_rollout(app)
    deltas = await stream_chat(app, active, lambda _: first_delta.set())
    (call,) = await recorded_calls(app)
    assert "".join(deltas) == call.response_text == TEXT
    assert call.response_ids == ids
    assert call.response_versions == (0,) * len(ids)
    assert deltas[0] == tokenizer.decode(ids[:1])
    if grouped:
        assert len(deltas) == 2
    else:
        assert len(deltas) > len(ids) // 2
