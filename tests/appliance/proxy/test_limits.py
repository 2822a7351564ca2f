"""The proxy's limits: model calls held at once, live rollouts, body size.

Each limit, once reached, refuses with a clear error in the surface's shape (429 with a code and
``Retry-After``, or 413), records nothing for the refused call, and lets the next call through
once there is room again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.chat.tokenizer import Tokenizer
from appliance.config import load_config
from contracts.errors import ConfigError, Overloaded
from store.events import LLMCallRefused
from tests.appliance.proxy.fakes import HeldEngine
from tests.support import make_config, register_rollout

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    config = make_config(tmp_path, tiny_model_dir, max_queued_calls=2, max_rollouts=3, max_body_bytes=2048)
    async with Appliance(config) as appliance:
        yield appliance


@pytest.fixture
def held(app: Appliance, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> HeldEngine:
    engine = HeldEngine(Tokenizer.from_model_dir(tiny_model_dir))
    monkeypatch.setattr(app.engine, "generate", engine.generate)
    return engine


async def post(
    session: aiohttp.ClientSession, url: str, token: str, body: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as response:
        if response.content_type != "application/json":  # a stream: its events as text
            return response.status, dict(response.headers), {"stream": await response.text()}
        return response.status, dict(response.headers), await response.json()


def admin(app: Appliance) -> dict[str, str]:
    return {"Authorization": f"Bearer {app.admin_token}"}


async def test_calls_beyond_max_queued_calls_get_429_and_nothing_is_recorded(
    app: Appliance, held: HeldEngine
) -> None:
    active = register_rollout(app)
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1"
    async with aiohttp.ClientSession() as session:
        first = [
            asyncio.create_task(post(session, url + "/chat/completions", active.token, CHAT)),
            asyncio.create_task(
                post(session, url + "/chat/completions", active.token, {**CHAT, "stream": True})
            ),
        ]
        await held.waiting_for(2)
        before = app.store.last_position

        status, headers, body = await post(session, url + "/chat/completions", active.token, CHAT)
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert body["error"]["code"] == "too_many_queued_calls"
        assert body["error"]["type"] == "rate_limit_error"
        assert "max_queued_calls" in body["error"]["message"]

        # The Anthropic surface refuses in its own shape.
        status, headers, body = await post(session, url + "/messages", active.token, MESSAGES)
        assert status == 429 and "Retry-After" in headers
        assert body == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": body["error"]["message"]},
        }
        assert app.store.last_position == before

        held.release.set()
        statuses = [status for status, _, _ in await asyncio.gather(*first)]
        assert statuses == [200, 200]
        # Room again: the next call goes through.
        status, _, body = await post(session, url + "/chat/completions", active.token, CHAT)
        assert status == 200 and body["choices"][0]["message"]["content"]


async def test_routes_other_than_model_calls_are_not_limited(app: Appliance, held: HeldEngine) -> None:
    active = register_rollout(app)
    url = f"{app.proxy_url}/rollouts/{active.rollout}"
    async with aiohttp.ClientSession() as session:
        calls = [
            asyncio.create_task(post(session, url + "/v1/chat/completions", active.token, CHAT))
            for _ in range(2)
        ]
        await held.waiting_for(2)
        status, _, body = await post(session, url + "/reward", active.token, {"reward": 1.0})
        assert status == 200 and body["reward"] == 1.0
        async with session.get(f"{app.proxy_url}/healthz") as response:
            assert response.status == 200
        async with session.get(f"{app.proxy_url}/admin/status", headers=admin(app)) as response:
            status_body = await response.json()
        assert status_body["calls_held"] == 2
        held.release.set()
        await asyncio.gather(*calls)
        async with session.get(f"{app.proxy_url}/admin/status", headers=admin(app)) as response:
            assert (await response.json())["calls_held"] == 0


async def test_a_body_over_max_body_bytes_gets_413_and_only_the_refusal_is_recorded(app: Appliance) -> None:
    active = register_rollout(app)
    before = app.store.last_position
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
    async with aiohttp.ClientSession() as session:
        status, _, body = await post(
            session, f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions", active.token, huge
        )
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert "2048 bytes" in body["error"]["message"]
    # No call: the refusal alone (the rollout's calls that failed are counted).
    (refused,) = [stored.event for stored in await app.store.read(before)]
    assert isinstance(refused, LLMCallRefused)
    assert (refused.rollout, refused.status, refused.code) == (active.rollout, 413, "request_too_large")


async def test_registering_beyond_max_rollouts_fails_with_too_many_rollouts(app: Appliance) -> None:
    for i in range(3):
        app.registry.register(f"r{i}", task_id="t", group="g", task={})
    app.registry.default()  # the rollout-less /v1 conversation does not count
    with pytest.raises(Overloaded) as refused:
        app.registry.register("r3", task_id="t", group="g", task={})
    assert refused.value.status == 429
    assert refused.value.code == "too_many_rollouts"
    assert app.registry.get("r3") is None
    app.registry.unregister("r0")
    assert app.registry.register("r3", task_id="t", group="g", task={}).rollout == "r3"
    assert len(app.registry) == 3


@pytest.mark.parametrize("name", ["max_rollouts", "max_queued_calls", "max_body_bytes"])
def test_limits_below_one_are_config_errors(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_config(overrides={name: 0}, env={})


def test_limit_defaults_hold_a_thousand_harness_connections() -> None:
    config = load_config(env={})
    assert config.proxy.max_queued_calls >= 1000
    assert config.proxy.max_rollouts >= 1000
    assert config.proxy.max_body_bytes == 4 * 1024 * 1024
