"""The Completions surface through the real openai SDK: text and token-id prompts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from appliance.app import Appliance
from appliance.rollouts.registry import ActiveRollout
from tests.support import make_config
from tests.support import openai_client as client
from tests.support import recorded_calls as recorded


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


@pytest.fixture
def active(app: Appliance) -> ActiveRollout:
    return app.registry.register("r1", task_id="t", group="g", task={})


async def test_text_prompt_and_its_continuation_are_one_token_sequence(
    app: Appliance, active: ActiveRollout
) -> None:
    tokenizer = app.registry._tokenizer
    async with client(app, active) as oai:
        first = await oai.completions.create(model="m", prompt="Q: 2 + 2 =", max_tokens=6, logprobs=1)
        text = "Q: 2 + 2 =" + first.choices[0].text + "\nQ: 3 + 3 ="
        second = await oai.completions.create(model="m", prompt=text, max_tokens=6)
    one, two = await recorded(app)
    assert one.surface == "openai.completions"
    assert list(one.prompt_ids) == tokenizer.encode("Q: 2 + 2 =")
    body = [t for t in one.response_ids if t != tokenizer.im_end_id]
    # The continuation reuses the exact sampled ids, then tokenizes only the new text.
    assert list(two.prompt_ids) == list(one.prompt_ids) + body + tokenizer.encode("\nQ: 3 + 3 =")
    assert first.choices[0].logprobs is not None
    assert first.choices[0].logprobs.token_logprobs == pytest.approx(list(one.response_logprobs), abs=1e-6)
    assert second.usage is not None and second.usage.prompt_tokens == len(two.prompt_ids)


async def test_token_id_prompt_echo_and_n(app: Appliance, active: ActiveRollout) -> None:
    tokenizer = app.registry._tokenizer
    ids = tokenizer.encode("The sum is")
    async with client(app, active) as oai:
        response = await oai.completions.create(model="m", prompt=ids, max_tokens=4, n=2, echo=True)
    calls = await recorded(app)
    assert len(calls) == len(response.choices) == 2
    assert all(list(c.prompt_ids) == ids for c in calls)
    assert all(choice.text.startswith("The sum is") for choice in response.choices)


async def test_streaming_completion(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        stream = await oai.completions.create(model="m", prompt="Count: 1 2 3", max_tokens=8, stream=True)
        chunks = [c async for c in stream]
    (call,) = await recorded(app)
    assert "".join(c.choices[0].text for c in chunks) == call.response_text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "prompt", [None, 5, [], [1, "a"], [[1, 2], 3], [10**9], [-1]], ids=lambda p: repr(p)[:20]
)
async def test_bad_prompts(app: Appliance, active: ActiveRollout, prompt: object) -> None:
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            f"{app.proxy_url}/rollouts/r1/v1/completions",
            json={"model": "m", "prompt": prompt},
            headers={"Authorization": f"Bearer {active.token}"},
        )
        payload = await response.json()
    assert response.status == 400
    assert payload["error"]["param"] == "prompt"
    assert await recorded(app) == []


async def test_empty_prompt_starts_a_new_document(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        response = await oai.completions.create(model="m", prompt="", max_tokens=4)
    (call,) = await recorded(app)
    assert list(call.prompt_ids) == [app.registry._tokenizer.document_start_id]
    assert response.choices[0].text == call.response_text and call.response_ids


async def test_max_tokens_zero_samples_nothing(app: Appliance, active: ActiveRollout) -> None:
    """As OpenAI answers it: the prompt alone with echo, else an empty completion cut at its length."""
    async with client(app, active) as oai:
        echoed = await oai.completions.create(model="m", prompt="The sum is", max_tokens=0, echo=True)
        empty = await oai.completions.create(model="m", prompt="The sum is", max_tokens=0, logprobs=1)
    assert echoed.choices[0].text == "The sum is" and echoed.choices[0].finish_reason == "length"
    assert empty.choices[0].text == "" and empty.choices[0].finish_reason == "length"
    assert empty.choices[0].logprobs is not None and empty.choices[0].logprobs.tokens == []
    prompt_tokens = len(app.registry._tokenizer.encode("The sum is"))
    assert echoed.usage is not None and (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (
        prompt_tokens,
        0,
    )
    async with client(app, active) as oai:
        stream = await oai.completions.create(
            model="m", prompt="The sum is", max_tokens=0, echo=True, stream=True
        )
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "The sum is"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert await recorded(app) == []  # nothing reached the engine


async def test_empty_stop_strings_are_ignored(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        response = await oai.completions.create(
            model="m", prompt="Count: 1 2 3", max_tokens=6, stop=["", "7"]
        )
        alone = await oai.completions.create(model="m", prompt="Count: 1 2 3", max_tokens=6, stop="")
    first, second = await recorded(app)
    assert response.choices[0].text == first.response_text and "7" not in response.choices[0].text
    assert first.response_ids and second.response_ids and alone.choices[0].text == second.response_text


async def test_logprobs_zero_gives_an_empty_object_per_token(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        response = await oai.completions.create(model="m", prompt="The sum is", max_tokens=4, logprobs=0)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens
    assert logprobs.top_logprobs == [{} for _ in logprobs.tokens]


async def test_integral_floats_are_integers_and_fractions_are_400s(
    app: Appliance, active: ActiveRollout
) -> None:
    async with aiohttp.ClientSession() as http:

        async def post(body: dict[str, object]) -> tuple[int, dict[str, Any]]:
            response = await http.post(
                f"{app.proxy_url}/rollouts/r1/v1/completions",
                json={"model": "m", "prompt": "The sum is", **body},
                headers={"Authorization": f"Bearer {active.token}"},
            )
            payload: dict[str, Any] = await response.json()
            return response.status, payload

        status, payload = await post({"max_tokens": 3.0, "logprobs": 2.0, "n": 1.0, "seed": 0.0})
        assert status == 200, payload
        assert all(len(top) <= 2 for top in payload["choices"][0]["logprobs"]["top_logprobs"])
        for field in ("max_tokens", "logprobs", "n", "seed", "best_of"):
            status, payload = await post({field: 1.5})
            assert status == 400 and payload["error"]["param"] == field, payload
    (call,) = await recorded(app)
    assert (call.sampling["max_tokens"], call.sampling["top_logprobs"], call.sampling["seed"]) == (3, 2, 0)


async def post_completion(
    app: Appliance, active: ActiveRollout, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            f"{app.proxy_url}/rollouts/{active.rollout}/v1/completions",
            json={"model": "m", "prompt": "The sum is", "max_tokens": 2, **body},
            headers={"Authorization": f"Bearer {active.token}"},
        )
        payload: dict[str, Any] = await response.json()
        return response.status, payload


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"presence_penalty": 2}, "presence_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"best_of": 2, "n": 1}, "best_of"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"suffix": " and that is all."}, "suffix"),
    ],
)
async def test_fields_the_appliance_cannot_honour_are_refused(
    app: Appliance, active: ActiveRollout, body: dict[str, Any], field: str
) -> None:
    status, payload = await post_completion(app, active, body)
    assert status == 400, payload
    assert payload["error"]["param"] == field and "not supported" in payload["error"]["message"]
    assert await recorded(app) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", 5),
        ("logit_bias", "none"),
        ("presence_penalty", True),
        ("stream", 1),
        ("stream_options", "usage"),
        ("stream_options", {"include_usage": 1}),
    ],
)
async def test_badly_typed_fields_are_400s_naming_the_field(
    app: Appliance, active: ActiveRollout, field: str, value: Any
) -> None:
    status, payload = await post_completion(app, active, {field: value})
    assert status == 400 and payload["error"]["param"] == field, payload


async def test_defaults_of_unsupported_fields_are_accepted(app: Appliance, active: ActiveRollout) -> None:
    body = {
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": {},
        "suffix": "",
        "best_of": 2,
        "n": 2,
    }
    status, payload = await post_completion(app, active, body)
    assert status == 200, payload
    assert len(payload["choices"]) == 2


@pytest.mark.parametrize("n", [1, 2])
async def test_best_of_zero_is_accepted_as_no_extra_candidates(
    app: Appliance, active: ActiveRollout, n: int
) -> None:
    """The spec's range for ``best_of`` starts at 0: no candidates beyond the n returned."""
    status, payload = await post_completion(app, active, {"best_of": 0, "n": n})
    assert status == 200, payload
    assert len(payload["choices"]) == n
    assert len(await recorded(app)) == n


async def test_streaming_usage_when_asked(app: Appliance, active: ActiveRollout) -> None:
    async with client(app, active) as oai:
        stream = await oai.completions.create(
            model="m",
            prompt="Count: 1 2 3",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    (call,) = await recorded(app)
    (last,) = [c for c in chunks if c.usage is not None]
    assert last is chunks[-1] and last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(call.prompt_ids),
        len(call.response_ids),
    )


@pytest.mark.parametrize("max_tokens", [0, 5])
async def test_echo_with_logprobs_scores_the_prompt(
    app: Appliance, active: ActiveRollout, tiny_model_dir: Path, max_tokens: int
) -> None:
    """As OpenAI answers it: the prompt's tokens come first in ``logprobs`` (the first with no
    log-prob and no alternatives), each the model's own log-prob of that token after the ones
    before it; the offsets count from the start of the echoed prompt."""
    tokenizer = app.registry._tokenizer
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt)
    async with client(app, active) as oai:
        response = await oai.completions.create(
            model="m", prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0
        )
    choice = response.choices[0]
    assert choice.text.startswith(prompt) and choice.logprobs is not None
    logprobs = choice.logprobs
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    sampled = len(logprobs.tokens) - len(ids)
    assert sampled == (response.usage.completion_tokens if response.usage else -1)
    assert logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[: len(ids)]) == prompt
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    # The model's own distribution, computed here without the appliance.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-4)
        top = logprobs.top_logprobs[i]
        assert top is not None and len(top) == 2
        best = expected[i - 1].topk(2)
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)
    # The sampled part is still recorded exactly as it was sampled (nothing for max_tokens 0).
    calls = await recorded(app)
    assert len(calls) == (1 if max_tokens else 0)
    if calls:
        assert logprobs.token_logprobs[len(ids) :] == pytest.approx(
            list(calls[0].response_logprobs), abs=1e-6
        )
