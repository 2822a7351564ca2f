"""Load: a thousand harness connections streaming at once through a real appliance.

The proxy, store and render path are real; the engine's ``generate`` is a fast deterministic
fake (``fakes.FastEngine``) that holds every generation after its first token until all of
them have started, so the thousand streams are provably open at the same moment. Two waves
run; the process's resident memory after the second is compared with after the first, so
growth that scales with the calls served (a leak per connection, per stream, per event) shows.
"""

from __future__ import annotations

import asyncio
import gc
import json
import resource
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from appliance.rollouts.registry import ActiveRollout
from tests.appliance.proxy.fakes import FastEngine
from tests.support import make_config, recorded_calls, register_rollout

CONNECTIONS = 1000
#: Generous: a leak of ~10 KiB per call over a wave of 1,000 would already be 10 MiB.
RSS_GROWTH_LIMIT = 40 * 1024 * 1024


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(autouse=True)
def enough_file_descriptors() -> None:
    """Both ends of every connection live in this process: ~2,000 sockets plus the rest."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * CONNECTIONS + 256
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


async def stream_one(session: aiohttp.ClientSession, url: str, rollout: ActiveRollout) -> str:
    """One streamed chat completion; returns its text."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"hi {rollout.rollout}"}]}
    text = ""
    async with session.post(
        url.format(rollout=rollout.rollout), json=body, headers={"Authorization": f"Bearer {rollout.token}"}
    ) as response:
        assert response.status == 200, await response.text()
        done = False
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["delta"].get("content") or ""
        assert done
    return text


async def wave(app: Appliance, engine: FastEngine, rollouts: list[ActiveRollout]) -> list[str]:
    """All rollouts stream at once; the engine holds them until every one has started."""
    engine.hold(len(rollouts))
    url = app.proxy_url + "/rollouts/{rollout}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(stream_one(session, url, r) for r in rollouts))


async def test_a_thousand_concurrent_streams_complete_with_bounded_memory(
    app: Appliance, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    engine = FastEngine(tokenizer, text="four")
    monkeypatch.setattr(app.engine, "generate", engine.generate)
    rollouts = [register_rollout(app, f"r{i:04d}") for i in range(CONNECTIONS)]

    texts = await wave(app, engine, rollouts)
    assert texts == ["four"] * CONNECTIONS
    assert engine.peak == CONNECTIONS  # every stream was open at once
    gc.collect()
    after_first = rss_bytes()

    texts = await wave(app, engine, rollouts)
    assert texts == ["four"] * CONNECTIONS
    gc.collect()
    growth = rss_bytes() - after_first
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth / 2**20:.1f} MiB over the second wave"

    calls = await recorded_calls(app)
    assert len(calls) == 2 * CONNECTIONS
    assert {c.finish_reason for c in calls} == {"stop"}
    assert len({c.rollout for c in calls}) == CONNECTIONS
