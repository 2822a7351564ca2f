"""Fields the appliance does not act on are still checked as the APIs check them: a value the API
refuses (an unknown enum value, a negative count, a string for a boolean) is a 400 naming the
parameter, in the surface's error shape, never accepted silently; every value the API takes is
accepted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.app import Appliance
from tests.support import make_config, recorded_calls, register_rollout, rollout_base

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 2}
MESSAGES: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
BASES = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


async def post(app: Appliance, surface: str, extra: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    active = app.registry._active.get("r1") or register_rollout(app)
    headers = {"Authorization": f"Bearer {active.token}", "anthropic-version": "2023-06-01"}
    if surface != "messages":
        del headers["anthropic-version"]
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            rollout_base(app, active) + ROUTES[surface], json={**BASES[surface], **extra}, headers=headers
        ) as response,
    ):
        return response.status, await response.json()


#: (surface, fields added to a good body, the parameter the 400 names).
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("responses", {"service_tier": "bogus"}, "service_tier"),
    ("responses", {"reasoning": {"effort": "x"}}, "reasoning.effort"),
    ("responses", {"reasoning": {"summary": "x"}}, "reasoning.summary"),
    ("responses", {"reasoning": "high"}, "reasoning"),
    ("responses", {"text": {"verbosity": "x"}}, "text.verbosity"),
    ("responses", {"background": "x"}, "background"),
    ("responses", {"max_tool_calls": -1}, "max_tool_calls"),
    ("responses", {"max_tool_calls": 1.5}, "max_tool_calls"),
    ("responses", {"prompt_cache_key": 3}, "prompt_cache_key"),
    ("responses", {"safety_identifier": ["x"]}, "safety_identifier"),
    ("responses", {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ("responses", {"stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ("chat", {"service_tier": "bogus"}, "service_tier"),
    ("chat", {"reasoning_effort": "x"}, "reasoning_effort"),
    ("chat", {"verbosity": "x"}, "verbosity"),
    ("chat", {"store": "yes"}, "store"),
    ("chat", {"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ("chat", {"user": 7}, "user"),
    ("chat", {"prompt_cache_key": 3}, "prompt_cache_key"),
    ("chat", {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ("chat", {"metadata": {"k": 1}}, "metadata"),
    ("chat", {"modalities": ["smell"]}, "modalities"),
    ("messages", {"service_tier": "bogus"}, "service_tier"),
    ("messages", {"metadata": {"user_id": 5}}, "metadata.user_id"),
    ("messages", {"thinking": {"type": "sometimes"}}, "thinking.type"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ("messages", {"stop_sequences": [1]}, "stop_sequences"),
]
#: (surface, fields added to a good body), each value one the API takes.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    (
        "responses",
        {
            "service_tier": "flex",
            "reasoning": {"effort": "low", "summary": "auto"},
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "background": False,
            "max_tool_calls": 0,
            "prompt_cache_key": "k",
            "safety_identifier": "s",
            "prompt_cache_retention": "24h",
        },
    ),
    ("responses", {"service_tier": None, "reasoning": None, "max_tool_calls": None, "background": None}),
    (
        "chat",
        {
            "service_tier": "auto",
            "reasoning_effort": "minimal",
            "verbosity": "high",
            "store": False,
            "parallel_tool_calls": True,
            "user": "u",
            "prompt_cache_key": "k",
            "prompt_cache_retention": "in_memory",
            "metadata": {"k": "v"},
            "modalities": ["text"],
        },
    ),
    (
        "messages",
        {
            "service_tier": "standard_only",
            "metadata": {"user_id": "u"},
            "thinking": {"type": "disabled"},
            "stop_sequences": ["x"],
        },
    ),
]


async def test_a_value_the_api_refuses_is_a_400_naming_the_parameter(app: Appliance) -> None:
    for surface, extra, param in REFUSED:
        status, body = await post(app, surface, extra)
        assert status == 400, (extra, body)
        if surface == "messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert param in body["error"]["message"], (extra, body)
        else:
            assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["param"] == param, (extra, body)
            assert param.rsplit(".", 1)[-1] in body["error"]["message"], (extra, body)
    assert await recorded_calls(app) == []  # nothing was generated


async def test_every_value_the_api_takes_is_accepted(app: Appliance) -> None:
    for surface, extra in ACCEPTED:
        status, body = await post(app, surface, extra)
        assert status == 200, (extra, body)
