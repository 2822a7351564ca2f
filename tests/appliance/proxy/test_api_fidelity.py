"""Shapes clients depend on beyond the model calls: the models routes (in OpenAI's or Anthropic's
shape, as the client asks) and the context-overflow error worded as each API words it, which
clients match on to trim a conversation (issue 16)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from anthropic import AsyncAnthropic

from appliance.app import Appliance
from appliance.rollouts.registry import ActiveRollout
from tests.support import make_config, recorded_calls
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


#: Status, ``type`` and ``code`` of OpenAI's answer to a context overflow (chat, Responses).
OVERFLOW = (400, "invalid_request_error", "context_length_exceeded")


def _overflow_fields(error: openai.BadRequestError) -> tuple[int, str | None, str | None, str | None, str]:
    """What a client of OpenAI's API can read off an overflow, field for field (the text as the
    body has it: openai 3.x prefixes ``message`` with the status)."""
    assert isinstance(error.body, dict)
    return (error.status_code, error.type, error.code, error.param, error.body["message"])


async def test_chat_completions_word_an_overflow_as_openai_does(
    app: Appliance, litellm_recognises: Recognises
) -> None:
    """A prompt that alone exceeds the context and one that leaves less room than ``max_tokens``
    are told apart as OpenAI's chat completions tell them apart (the first is the one trimming
    the conversation cures), both ``context_length_exceeded`` on ``messages``."""
    active = rollout(app)
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.chat.completions.create(
                model=app.model_name, messages=[{"role": "user", "content": LONG}], max_tokens=100
            )
        with pytest.raises(openai.BadRequestError) as no_room:
            await client.chat.completions.create(
                model=app.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2048
            )
    status, kind, code, param, message = _overflow_fields(too_long.value)
    assert (status, kind, code, param) == (*OVERFLOW, "messages")
    match = re.fullmatch(
        r"This model's maximum context length is 2048 tokens\. However, your messages resulted in "
        r"(\d+) tokens\. Please reduce the length of the messages\.",
        message,
    )
    assert match is not None, message
    assert int(match[1]) > 2048
    status, kind, code, param, message = _overflow_fields(no_room.value)
    assert (status, kind, code, param) == (*OVERFLOW, "messages")
    match = OPENAI_OVERFLOW.fullmatch(message)
    assert match is not None, message
    limit, total, prompt, completion = map(int, match.groups())
    assert (limit, completion, total) == (2048, 2048, prompt + 2048) and 0 < prompt < 2048
    for error in (too_long.value, no_room.value):
        assert litellm_recognises is None or litellm_recognises(error.message)
        # openai 3.x keeps the body out of the exception's text: the code is an attribute only, so
        # langchain-openai's check for it in ``str(error)`` misses this answer, as it misses the
        # same answer from OpenAI's own API (harness_adapters/README.md).
        if int(openai.__version__.split(".")[0]) >= 3:
            assert str(error) == f"Error code: 400 - {_overflow_fields(error)[4]}"
            assert "context_length_exceeded" not in str(error)


async def test_legacy_completions_word_an_overflow_as_openai_does(
    app: Appliance, litellm_recognises: Recognises
) -> None:
    """OpenAI's legacy completions endpoint words every overflow one way, and sends it with
    ``param`` and ``code`` null."""
    active = rollout(app)
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model=app.model_name, prompt=LONG, max_tokens=100)
        with pytest.raises(openai.BadRequestError) as no_room:
            await client.completions.create(model=app.model_name, prompt=[5, 6, 7], max_tokens=2048)
    assert _overflow_fields(no_room.value)[4] == (
        "This model's maximum context length is 2048 tokens, however you requested 2051 tokens "
        "(3 in your prompt; 2048 for the completion). Please reduce your prompt; or completion length."
    )
    status, kind, code, param, message = _overflow_fields(too_long.value)
    assert (status, kind, code, param) == (400, "invalid_request_error", None, None)
    assert isinstance(no_room.value.body, dict)
    assert (no_room.value.body["param"], no_room.value.body["code"]) == (None, None)
    match = re.fullmatch(
        r"This model's maximum context length is 2048 tokens, however you requested (\d+) tokens "
        r"\((\d+) in your prompt; 100 for the completion\)\. Please reduce your prompt; or completion "
        r"length\.",
        message,
    )
    assert match is not None, message
    assert int(match[1]) == int(match[2]) + 100 and int(match[2]) > 2048
    for error in (too_long.value, no_room.value):
        assert litellm_recognises is None or litellm_recognises(error.message)


async def test_responses_word_an_overflow_as_openai_does(
    app: Appliance, litellm_recognises: Recognises
) -> None:
    """The Responses API's own wording for an input longer than the context, on ``input``; an
    input that fits but leaves less room than ``max_output_tokens`` says so with the numbers."""
    active = rollout(app)
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.responses.create(model=app.model_name, input=LONG, max_output_tokens=100)
        with pytest.raises(openai.BadRequestError) as no_room:
            await client.responses.create(model=app.model_name, input="hi", max_output_tokens=2048)
    assert _overflow_fields(too_long.value) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "input",
        "Your input exceeds the context window of this model. Please adjust your input and try again.",
    )
    status, kind, code, param, message = _overflow_fields(no_room.value)
    assert (status, kind, code, param) == (*OVERFLOW, "input")
    match = OPENAI_OVERFLOW.fullmatch(message)
    assert match is not None, message
    limit, total, prompt, completion = map(int, match.groups())
    assert (limit, completion, total) == (2048, 2048, prompt + 2048) and 0 < prompt < 2048
    # litellm's Responses client reads the body as sent, where the code is.
    assert litellm_recognises is None or litellm_recognises(too_long.value.response.text)
    assert litellm_recognises is None or litellm_recognises(no_room.value.message)


async def test_anthropic_surface_words_an_overflow_as_anthropic_does(
    app: Appliance, litellm_recognises: Recognises
) -> None:
    """Says "prompt is too long" only for a prompt that alone exceeds the context (clients trim the
    conversation on it); a prompt that fits with too large a ``max_tokens`` gets Anthropic's
    "input length and `max_tokens` exceed context limit", so trimming is not tried in vain."""
    active = rollout(app)
    async with anthropic_sdk(app, active) as client:
        with pytest.raises(anthropic.BadRequestError) as too_long:
            await client.messages.create(
                model=app.model_name, max_tokens=100, messages=[{"role": "user", "content": LONG}]
            )
        with pytest.raises(anthropic.BadRequestError) as no_room:
            await client.messages.create(
                model=app.model_name, max_tokens=2048, messages=[{"role": "user", "content": "hi"}]
            )
    bodies = []
    for caught in (too_long, no_room):
        assert caught.value.status_code == 400
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        bodies.append(body["error"]["message"])
        assert litellm_recognises is None or litellm_recognises(caught.value.message)
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > 2048 maximum", bodies[0])
    assert match is not None, bodies[0]
    assert int(match[1]) > 2048
    match = re.fullmatch(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ 2048 > 2048, "
        r"decrease input length or `max_tokens` and try again",
        bodies[1],
    )
    assert match is not None, bodies[1]
    assert 0 < int(match[1]) < 2048
    assert "prompt is too long" not in bodies[1]


async def test_a_call_that_asks_for_no_length_gets_what_the_context_leaves(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """No ``max_tokens`` in the request and none configured: up to ``max_tokens_cap``, and no more
    than the prompt leaves of the context (never a 400 for want of room, never a cut at 16)."""
    config = make_config(tmp_path, tiny_model_dir, max_tokens=None, max_tokens_cap=40)
    async with Appliance(config) as app:
        active = rollout(app)
        room = 7
        ids = [5] * (app.engine.max_context - room)
        async with sdk(app, active) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await client.completions.create(model="m", prompt=ids)
            await client.responses.create(model="m", input="hi")
            with pytest.raises(openai.BadRequestError) as caught:
                await client.completions.create(model="m", prompt=ids, max_tokens=room + 1)
            assert f"however you requested {len(ids) + room + 1} tokens" in str(caught.value)
        calls = await recorded_calls(app)
        assert [c.sampling["max_tokens"] for c in calls] == [40, room, 40]


async def test_top_k_is_honoured_on_every_surface_that_takes_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Anthropic's ``top_k`` (and the same extension on the OpenAI surfaces, as vLLM takes it):
    top-k 1 at temperature 1 samples what greedy decoding does, and the call records it."""
    # The client's temperature is served (the training default forces 1).
    async with Appliance(make_config(tmp_path, tiny_model_dir, temperature="none")) as app:
        await _top_k_calls(app)


async def _top_k_calls(app: Appliance) -> None:
    active = rollout(app)
    ask: Any = [{"role": "user", "content": "Say something long."}]
    async with sdk(app, active) as client:
        greedy = await client.chat.completions.create(model="m", messages=ask, max_tokens=12, temperature=0)
        for seed in range(3):
            top1 = await client.chat.completions.create(
                model="m", messages=ask, max_tokens=12, temperature=1, seed=seed, extra_body={"top_k": 1}
            )
            assert top1.choices[0].message.content == greedy.choices[0].message.content
        completion = await client.completions.create(model="m", prompt="abc", max_tokens=8, temperature=0)
        top1_text = await client.completions.create(
            model="m", prompt="abc", max_tokens=8, temperature=1, seed=5, extra_body={"top_k": 1}
        )
        assert top1_text.choices[0].text == completion.choices[0].text
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="m", messages=ask, extra_body={"top_k": 1.5})
        assert caught.value.param == "top_k"
    claude = anthropic_sdk(app, active)
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 12, "messages": ask, "stream": False}
    # This SDK release no longer has typed sampling parameters; they travel in the body.
    cold = await claude.messages.create(**kwargs, extra_body={"temperature": 0})
    warm = await claude.messages.create(**kwargs, extra_body={"temperature": 1, "top_k": 1})
    assert warm.content == cold.content
    await claude.close()
    calls = await recorded_calls(app)
    assert [c.sampling["top_k"] for c in calls] == [0, 1, 1, 1, 0, 1, 0, 1]


async def test_an_overflow_says_what_was_asked_and_what_the_cap_made_of_it(app: Appliance) -> None:
    """A completion length past ``max_tokens_cap`` is capped before the context is checked: the
    overflow's numbers are the capped ones (clients compute a smaller length from them), and the
    message says what the request asked and what the cap made of it."""
    active = rollout(app)
    hi = [{"role": "user", "content": "hi"}]
    note = "100000 completion tokens were asked for; the appliance's max_tokens_cap made that 2048"
    async with sdk(app, active) as client:
        with pytest.raises(openai.BadRequestError) as chat:
            await client.chat.completions.create(model="m", messages=hi, max_tokens=100_000)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as responses:
            await client.responses.create(model="m", input="hi", max_output_tokens=100_000)
        with pytest.raises(openai.BadRequestError) as fits:
            await client.chat.completions.create(model="m", messages=hi, max_tokens=2048)  # type: ignore[arg-type]
    async with anthropic_sdk(app, active) as claude:
        with pytest.raises(anthropic.BadRequestError) as messages:
            # A timeout of its own: the SDK refuses so long a completion without one.
            await claude.messages.create(model=app.model_name, max_tokens=100_000, messages=hi, timeout=30)  # type: ignore[arg-type]
    for caught in (chat, responses):
        body = caught.value.body
        assert isinstance(body, dict) and note in body["message"], body
    assert OPENAI_OVERFLOW.match(chat.value.body["message"])  # type: ignore[index]
    assert "asked for" not in str(fits.value)  # nothing was capped: nothing to say
    body = messages.value.body
    assert isinstance(body, dict)
    text = body["error"]["message"]
    assert re.match(r"input length and `max_tokens` exceed context limit: \d+ \+ 2048 > 2048, ", text)
    assert note in text, text
