"""Shapes clients depend on beyond the model calls: the models routes (in OpenAI's or Anthropic's
shape, as the client asks) and the context-overflow error worded as each API words it, which
clients match on to trim a conversation (issue 16)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from anthropic import AsyncAnthropic

from appliance.app import Appliance
from appliance.rollouts import ActiveRollout
from tests.support import make_config
from tests.support import openai_client as sdk
from tests.support import register_rollout as rollout
from tests.support import rollout_base as base

#: Far past the tiny model's 2048-token context with any tokenizer.
LONG = " ".join(f"w{i}" for i in range(3000))
OPENAI_OVERFLOW = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length of the messages "
    r"or completion\."
)


# litellm's own pydantic models warn about themselves; nothing here can act on that.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.* using the `ReadOnly` qualifier:UserWarning",
    "ignore:Accessing the 'model_.*' attribute on the instance is deprecated:DeprecationWarning",
)


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


def anthropic_sdk(app: Appliance, active: ActiveRollout) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=base(app, active), api_key=active.token, max_retries=0)


#: What litellm, when installed, takes for a context overflow (None: it is not installed).
Recognises = Callable[[str], bool] | None


@pytest.fixture
def litellm_recognises(monkeypatch: pytest.MonkeyPatch) -> Recognises:
    """litellm's own check, imported offline (it reads the variable at its first import)."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from litellm.litellm_core_utils.exception_mapping_utils import ExceptionCheckers
    except ImportError:
        return None
    return ExceptionCheckers.is_error_str_context_window_exceeded


async def test_openai_sdk_retrieves_the_served_model(app: Appliance) -> None:
    active = rollout(app)
    async with sdk(app, active) as client:
        model = await client.models.retrieve(app.model_name)
        assert (model.id, model.object, model.owned_by) == (app.model_name, "model", "lightning-appliance")
        for other in ("gpt-4o", "org/other-model"):
            with pytest.raises(openai.NotFoundError) as caught:
                await client.models.retrieve(other)
            assert caught.value.code == "model_not_found"
            assert caught.value.type == "invalid_request_error"
            assert f"The model '{other}' does not exist" in caught.value.message
    # The rollout-less prefix serves the same route with the admin token.
    headers = {"Authorization": f"Bearer {app.admin_token}"}
    async with aiohttp.ClientSession() as http:
        response = await http.get(f"{app.proxy_url}/v1/models/{app.model_name}", headers=headers)
        assert response.status == 200
        assert (await response.json())["id"] == app.model_name
        refused = await http.get(f"{base(app, active)}/v1/models/{app.model_name}")
        assert refused.status == 401


async def test_anthropic_sdk_lists_and_retrieves_models(app: Appliance) -> None:
    active = rollout(app)
    async with anthropic_sdk(app, active) as client:
        page = await client.models.list()
        assert [(m.type, m.id, m.display_name) for m in page.data] == [
            ("model", app.model_name, app.model_name)
        ]
        assert (page.has_more, page.first_id, page.last_id) == (False, app.model_name, app.model_name)
        model = await client.models.retrieve(app.model_name)
        assert (model.type, model.id, model.created_at.year) == ("model", app.model_name, 1970)
        with pytest.raises(anthropic.NotFoundError) as caught:
            await client.models.retrieve("claude-sonnet-4-5")
    assert caught.value.status_code == 404
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": (
                f"The model 'claude-sonnet-4-5' does not exist; this appliance serves '{app.model_name}'"
            ),
        },
    }


async def test_x_api_key_alone_gets_anthropic_shapes(app: Appliance) -> None:
    active = rollout(app)
    async with aiohttp.ClientSession() as http:
        listed = await http.get(f"{base(app, active)}/v1/models", headers={"x-api-key": active.token})
        assert listed.status == 200
        body = await listed.json()
        assert body["has_more"] is False and body["data"][0]["type"] == "model"
        # With both headers, the bearer token wins: an OpenAI client.
        both = {"x-api-key": active.token, "Authorization": f"Bearer {active.token}"}
        listed = await http.get(f"{base(app, active)}/v1/models", headers=both)
        assert (await listed.json())["object"] == "list"


async def test_openai_surfaces_word_an_overflow_as_openai_does(
    app: Appliance, litellm_recognises: Recognises
) -> None:
    active = rollout(app)
    errors: list[openai.BadRequestError] = []
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=app.model_name, messages=[{"role": "user", "content": LONG}], max_tokens=100
            )
        errors.append(caught.value)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=app.model_name, prompt=LONG, max_tokens=100)
        errors.append(caught.value)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=app.model_name, input=LONG, max_output_tokens=100)
        errors.append(caught.value)
    for error in errors:
        assert (error.code, error.type, error.param) == (
            "context_length_exceeded",
            "invalid_request_error",
            "messages",
        )
        match = OPENAI_OVERFLOW.fullmatch(error.body["message"])  # type: ignore[index]
        assert match is not None, error.message
        limit, total, prompt, completion = map(int, match.groups())
        assert (limit, completion) == (2048, 100)
        assert total == prompt + completion and prompt > limit - completion
        assert litellm_recognises is None or litellm_recognises(error.message)


async def test_anthropic_surface_words_an_overflow_as_anthropic_does(
    app: Appliance, litellm_recognises: Recognises
) -> None:
    active = rollout(app)
    async with anthropic_sdk(app, active) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(
                model=app.model_name, max_tokens=100, messages=[{"role": "user", "content": LONG}]
            )
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", body["error"]["message"])
    assert match is not None, body
    prompt, limit = map(int, match.groups())
    assert limit == 2048 and prompt > limit - 100
    assert litellm_recognises is None or litellm_recognises(caught.value.message)
