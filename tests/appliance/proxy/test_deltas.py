"""Streamed text deltas: tokens handed over in groups make the same text as token by token, the
first token is not held back, and a proxy stream whose engine hands tokens over in groups sends
grouped deltas that concatenate to what is recorded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from appliance.app import Appliance
from appliance.chat.tokenizer import IncrementalDecoder, Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.proxy.deltas import TextDeltas, TokenArrivals, stream_safe
from appliance.proxy.http import DirectChunks
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


async def test_a_shortcut_takes_what_comes_while_the_taker_waits_and_only_then() -> None:
    arrivals = TokenArrivals()
    taken: list[list[int]] = []
    accept = True

    def shortcut(ids: Sequence[int]) -> bool:
        if accept:
            taken.append(list(ids))
        return accept

    arrivals.shortcut(shortcut)
    arrivals.add([1])  # nobody waits: the token waits for the taker
    assert taken == [] and await arrivals.take() == [1]
    waiting = asyncio.ensure_future(arrivals.take())
    await asyncio.sleep(0)
    arrivals.add([2, 3])
    arrivals.add([4])
    await asyncio.sleep(0)
    assert taken == [[2, 3], [4]] and not waiting.done()  # taken at once; the taker sleeps on
    accept = False
    arrivals.add([5])  # declined: the taker gets it
    assert await waiting == [5]
    accept = True
    arrivals.add([6])  # the taker is not waiting: kept in order behind nothing, for the taker
    waiting = asyncio.ensure_future(arrivals.take())
    await asyncio.sleep(0)
    assert await waiting == [6] and taken == [[2, 3], [4]]
    arrivals.shortcut(None)
    waiting = asyncio.ensure_future(arrivals.take())
    await asyncio.sleep(0)
    arrivals.add([7])
    arrivals.end()
    assert await waiting == [7] and await arrivals.take() is None
    assert taken == [[2, 3], [4]]


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


async def token_by_token(request: GenerateRequest, ids: tuple[int, ...], logprobs: tuple[float, ...]) -> None:
    """Hand ``ids`` over one at a time, a little apart (an engine at a slow pace)."""
    assert request.on_token is not None
    for token, logprob in zip(ids, logprobs, strict=True):
        request.on_token(token, logprob)
        await asyncio.sleep(0.002)


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
            await token_by_token(request, ids, logprobs)
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


@pytest.mark.parametrize("every", [1, 2, 3])
async def test_tokens_the_engine_hands_over_while_the_stream_waits_are_written_by_its_callback(
    app: Appliance, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """Token by token, with the stream's task waiting for each: the engine's callback writes each
    token's text to the client itself (``DirectChunks``), and where it may not (``every`` > 1:
    the client counts as behind for all but every ``every``-th group) the task writes it, in the
    stream's order. The client reads the same deltas either way, and the recorded text."""
    tokenizer = app.registry._tokenizer
    ids = (*tokenizer.encode(TEXT), tokenizer.im_end_id)
    logprobs = (-0.5,) * len(ids)
    direct: list[bytes] = []
    asked = 0
    write, ready = DirectChunks.write, DirectChunks.ready

    def counted_write(self: DirectChunks, data: bytes) -> None:
        direct.append(data)
        write(self, data)

    def sometimes_ready(self: DirectChunks) -> bool:
        nonlocal asked
        asked += 1
        return ready(self) and asked % every == 0

    monkeypatch.setattr(DirectChunks, "write", counted_write)
    monkeypatch.setattr(DirectChunks, "ready", sometimes_ready)

    async def generate(request: GenerateRequest) -> GenerateResult:
        await token_by_token(request, ids, logprobs)
        return GenerateResult(token_ids=ids, logprobs=logprobs, finish_reason="stop", policy_version=0)

    app.engine.generate = generate  # type: ignore[method-assign]
    active = register_rollout(app)
    deltas = await stream_chat(app, active)
    (call,) = await recorded_calls(app)
    assert "".join(deltas) == call.response_text == TEXT
    assert deltas == per_token(tokenizer, list(ids[:-1]))  # a delta per token, whoever wrote it
    texts = iter(deltas)
    # What the callback wrote is among the client's deltas, in their order.
    assert all(any(d == json.loads(c[6:])["choices"][0]["delta"]["content"] for d in texts) for c in direct)
    if every == 1:
        assert len(direct) >= len(deltas) - 1  # all but a first token taken before the wait
    else:
        assert 0 < len(direct) < len(deltas)


async def test_an_http_1_0_client_gets_its_stream_unchunked_to_the_close(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP/1.0 has no chunks: the stream is the body up to the connection's close, written by
    the stream's task alone (no ``DirectChunks`` for it)."""
    made: list[DirectChunks | None] = []
    of = DirectChunks.of

    def recorded_of(request: web.Request, response: web.StreamResponse) -> DirectChunks | None:
        made.append(of(request, response))
        return made[-1]

    monkeypatch.setattr(DirectChunks, "of", recorded_of)
    active = register_rollout(app)
    body = {"model": "m", "messages": [{"role": "user", "content": "Say it."}], "stream": True}
    async with (
        asyncio.timeout(30),
        aiohttp.ClientSession(version=aiohttp.HttpVersion10) as http,
        http.post(
            f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {active.token}"},
        ) as response,
    ):
        assert response.status == 200 and response.version == aiohttp.HttpVersion10
        assert "chunked" not in response.headers.get("Transfer-Encoding", "")
        raw = await response.read()
    (call,) = await recorded_calls(app)
    lines = [line for line in raw.split(b"\n") if line.startswith(b"data: {")]
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines)
    assert text == call.response_text and raw.endswith(b"data: [DONE]\n\n")
    assert made == [None]
