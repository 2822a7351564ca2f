"""The proxy through litellm, the client library most agent harnesses call models with.

litellm is pointed at a rollout's base URL the way a harness points it (``api_base`` and
``api_key``), on its ``openai/`` route (Chat Completions) plain and streaming, and on its
``anthropic/`` route (the Messages surface). Each call must answer what the proxy recorded:
the text, and usage equal to the recorded token counts.

litellm is imported inside the tests, after ``LITELLM_LOCAL_MODEL_COST_MAP`` is set: at import
it otherwise fetches its model cost map from the network.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.app import Appliance
from tests.support import make_config
from tests.support import recorded_calls as calls_recorded
from tests.support import register_rollout as rollout
from tests.support import rollout_base as base
from trainer.samples import build_samples

QUESTION = [{"role": "user", "content": "What is 1 + 2?"}]

# litellm's own pydantic models warn about themselves; nothing here can act on that.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.* using the `ReadOnly` qualifier:UserWarning",
    "ignore:Accessing the 'model_.*' attribute on the instance is deprecated:DeprecationWarning",
)


@pytest.fixture(autouse=True)
def offline_litellm(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network for litellm (its bundled cost map), no client settings from the environment.

    litellm is first imported here, after the variable is set (it reads it at import).
    """
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for name in ("OPENAI_BASE_URL", "OPENAI_API_BASE", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_BASE"):
        monkeypatch.delenv(name, raising=False)
    pytest.importorskip("litellm")


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


def looks_like_litellm(user_agent: str) -> bool:
    """litellm's openai route goes through the openai SDK, which names itself."""
    agent = user_agent.lower()
    return "openai" in agent or "litellm" in agent


async def test_chat_completion_through_litellm(app: Appliance) -> None:
    import litellm

    active = rollout(app)
    response = await litellm.acompletion(
        model=f"openai/{app.model_name}",
        api_base=base(app, active) + "/v1",
        api_key=active.token,
        messages=QUESTION,
        max_tokens=6,
        num_retries=0,
    )
    assert isinstance(response, litellm.ModelResponse)
    (call,) = await calls_recorded(app)
    choice = response.choices[0]
    assert isinstance(choice, litellm.Choices)
    assert (choice.message.content or "") == call.response_text
    assert choice.finish_reason == call.finish_reason
    assert call.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens == len(call.prompt_ids)
    assert usage.completion_tokens == len(call.response_ids) <= 6
    assert usage.total_tokens == len(call.prompt_ids) + len(call.response_ids)
    assert call.rollout == active.rollout
    assert call.surface == "openai.chat"
    assert call.request["messages"] == QUESTION
    assert call.request["max_tokens"] == 6
    assert len(call.response_logprobs) == len(call.response_ids)
    assert looks_like_litellm(call.user_agent), call.user_agent


async def test_streamed_chat_completion_through_litellm(app: Appliance) -> None:
    import litellm

    active = rollout(app)
    stream = await litellm.acompletion(
        model=f"openai/{app.model_name}",
        api_base=base(app, active) + "/v1",
        api_key=active.token,
        messages=QUESTION,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        num_retries=0,
    )
    assert isinstance(stream, litellm.CustomStreamWrapper)
    text = ""
    finish: list[str] = []
    usages: list[Any] = []
    async for chunk in stream:
        for streamed in chunk.choices:
            text += streamed.delta.content or ""
            if streamed.finish_reason:
                finish.append(streamed.finish_reason)
        if getattr(chunk, "usage", None) is not None:
            usages.append(chunk.usage)
    (call,) = await calls_recorded(app)
    assert text == call.response_text
    assert finish == [call.finish_reason]
    assert call.surface == "openai.chat"
    assert call.request["stream"] is True
    assert call.finish_reason in ("stop", "length")
    assert usages, "litellm passed no usage through although include_usage was asked for"
    assert usages[-1].prompt_tokens == len(call.prompt_ids)
    assert usages[-1].completion_tokens == len(call.response_ids) <= 6
    assert looks_like_litellm(call.user_agent), call.user_agent


async def test_litellm_history_is_spliced_into_one_sample(app: Appliance) -> None:
    """A harness that appends litellm's own message object to its history, then calls again."""
    import litellm

    active = rollout(app)
    kwargs: dict[str, Any] = {
        "model": f"openai/{app.model_name}",
        "api_base": base(app, active) + "/v1",
        "api_key": active.token,
        "max_tokens": 6,
        "num_retries": 0,
    }
    first = await litellm.acompletion(messages=QUESTION, **kwargs)
    assert isinstance(first, litellm.ModelResponse)
    choice = first.choices[0]
    assert isinstance(choice, litellm.Choices)
    history = [*QUESTION, choice.message.model_dump(), {"role": "user", "content": "And 2 + 3?"}]
    second = await litellm.acompletion(messages=history, **kwargs)
    assert isinstance(second, litellm.ModelResponse)

    one, two = await calls_recorded(app)
    assert two.unmatched_assistant_turns == 0
    assert two.spliced_tokens == len(one.response_ids)
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids
    (sample,) = build_samples([one, two])
    sampled = tuple(t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m)
    assert sampled == one.response_ids + two.response_ids
    assert sample.call_ids == (one.call_id, two.call_id)


async def test_messages_through_litellms_anthropic_route(app: Appliance) -> None:
    import litellm

    active = rollout(app)
    async with aiohttp.ClientSession() as http:
        probe = await http.post(
            base(app, active) + "/v1/messages",
            json={"model": app.model_name, "max_tokens": 1, "messages": QUESTION},
            headers={"x-api-key": active.token, "anthropic-version": "2023-06-01"},
        )
    if probe.status == 404:
        pytest.skip("the proxy has no Anthropic Messages surface (POST /v1/messages answers 404)")
    assert probe.status == 200, await probe.text()
    (probed,) = await calls_recorded(app)

    response = await litellm.acompletion(
        model=f"anthropic/{app.model_name}",
        api_base=base(app, active),
        api_key=active.token,
        messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
        max_tokens=6,
        num_retries=0,
    )
    assert isinstance(response, litellm.ModelResponse)
    calls = await calls_recorded(app)
    assert [c.call_id for c in calls[:1]] == [probed.call_id]
    (call,) = calls[1:]
    choice = response.choices[0]
    assert isinstance(choice, litellm.Choices)
    assert call.surface == "anthropic.messages"
    assert call.rollout == active.rollout
    assert call.request["system"] in ("Be brief.", [{"type": "text", "text": "Be brief."}])
    assert (choice.message.content or "") == call.response_text
    assert call.finish_reason in ("stop", "length")
    assert choice.finish_reason == call.finish_reason
    usage = response.usage
    assert usage.prompt_tokens == len(call.prompt_ids)
    assert usage.completion_tokens == len(call.response_ids) <= 6
