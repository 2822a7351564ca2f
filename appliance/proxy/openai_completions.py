"""The OpenAI Completions surface: ``POST /v1/completions`` on text or token-id prompts.

Owns the legacy completions shape: prompts as a string, a list of token ids, or a batch of
either; ``n`` choices per prompt; ``echo``; ``logprobs``; ``stop``; streaming for one prompt and
one choice. No chat template is applied. An empty text prompt starts from the document
separator; ``max_tokens: 0`` samples nothing (the prompt alone with ``echo``), as OpenAI answers
it. A text prompt that continues this rollout's previous prompt + completion reuses those exact
ids and tokenizes only the new text, so a harness that builds its transcript as text still
yields one exact token sequence.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from appliance.errors import ApplianceError, BadRequest
from appliance.proxy.calls import CallOutcome, PreparedCall
from appliance.proxy.http import (
    CALLS,
    SETTINGS,
    add_post,
    json_body,
    rollout_of,
    sse_send,
    sse_start,
    user_agent,
)
from appliance.proxy.validate import (
    flag,
    include_usage,
    number,
    optional_int,
    positive_int,
    refuse_distribution_changes,
    required_str,
    sampling_for,
    seed,
    stop_strings,
)
from appliance.rollouts import ActiveRollout

SURFACE = "openai.completions"
MAX_CHOICES = 16
#: OpenAI's limits: ``best_of`` up to 20 (served only equal to ``n``: each choice is sampled
#: once), and up to 5 alternatives per token in ``logprobs``.
MAX_BEST_OF = 20
MAX_LOGPROBS = 5


def _refuse_suffix(body: dict[str, Any]) -> None:
    """``suffix`` (text after the insertion point) needs fill-in-the-middle sampling, which the
    appliance does not do: a non-empty one is refused rather than dropped."""
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise BadRequest("'suffix' must be a string", param="suffix")
    if suffix:
        raise BadRequest(
            "'suffix' is not supported: the appliance only continues the prompt (no fill-in-the-middle)",
            param="suffix",
        )


def _prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return [list(value)]
    if isinstance(value, list) and value:
        out: list[str | list[int]] = []
        for item in value:
            if isinstance(item, str):
                out.append(item)
            elif (
                isinstance(item, list)
                and item
                and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
            ):
                out.append(list(item))
            else:
                raise BadRequest(
                    "'prompt' items must be strings or non-empty lists of token ids", param="prompt"
                )
        return out
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those", param="prompt")


def _prompt_ids(rollout: ActiveRollout, prompt: str | list[int], request: web.Request) -> list[int]:
    if isinstance(prompt, list):
        vocab = request.app[CALLS].tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise BadRequest(f"'prompt' token ids must lie in [0, {vocab})", param="prompt")
        return prompt
    tokenizer = request.app[CALLS].tokenizer
    if rollout.text_prefix and prompt.startswith(rollout.text_prefix):
        return rollout.text_prefix_ids + tokenizer.encode(prompt[len(rollout.text_prefix) :])
    # An empty prompt: the model starts a new document, as after the separator in pretraining.
    return tokenizer.encode(prompt) or [tokenizer.document_start_id]


def _choice(
    outcome: CallOutcome, index: int, prompt_text: str, echo: bool, logprobs: int | None, request: web.Request
) -> dict[str, Any]:
    text = (prompt_text if echo else "") + outcome.text
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "finish_reason": "length" if outcome.result.finish_reason == "length" else "stop",
        "logprobs": None,
    }
    if logprobs is not None:
        tokenizer = request.app[CALLS].tokenizer
        tokens = [tokenizer.decode([t]) for t in outcome.result.token_ids]
        offsets, at = [], len(prompt_text) if echo else 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": list(outcome.result.logprobs),
            # One object per token even with logprobs 0 (then each is empty), as OpenAI sends.
            "top_logprobs": [
                {tokenizer.decode([t]): lp for t, lp in top}
                for top in outcome.result.top_logprobs or [() for _ in tokens]
            ],
            "text_offset": offsets,
        }
    return choice


async def completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    model = required_str(body, "model")
    prompts = _prompts(body.get("prompt"))
    n = positive_int(body, "n") or 1
    stream = flag(body, "stream")
    usage = include_usage(body)
    if len(prompts) * n > MAX_CHOICES or (stream and len(prompts) * n > 1):
        raise BadRequest(f"at most {MAX_CHOICES} prompts x n (1 when streaming)", param="n")
    echo = flag(body, "echo")
    logprobs = optional_int(body, "logprobs", 0, MAX_LOGPROBS)
    best_of = positive_int(body, "best_of", MAX_BEST_OF)
    if best_of is not None and best_of != n:
        raise BadRequest(
            f"'best_of' {best_of} is not supported: each choice is sampled once and returned, so "
            f"best_of must equal n ({n}) or be left out",
            param="best_of",
        )
    _refuse_suffix(body)
    max_tokens = positive_int(body, "max_tokens", lo=0)
    refuse_distribution_changes(body)
    params = sampling_for(
        request.app[SETTINGS],
        max_tokens=max_tokens or None,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed(body),
        top_logprobs=logprobs or 0,
    )
    stop = stop_strings(body, "stop")
    rollout = rollout_of(request)
    calls = request.app[CALLS]
    tokenizer = calls.tokenizer
    if max_tokens == 0:
        return await _nothing_sampled(request, model, prompts, n, echo, logprobs is not None, stream)
    prepared: list[tuple[PreparedCall, str]] = []
    for prompt in prompts:
        ids = _prompt_ids(rollout, prompt, request)
        text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
        for _ in range(n):
            call = calls.prepare_tokens(
                rollout,
                prompt_ids=ids,
                params=params,
                surface=SURFACE,
                request=body,
                user_agent=user_agent(request),
                stop=stop,
            )
            prepared.append((call, text))

    def remember(outcome: CallOutcome, call: PreparedCall, prompt_text: str) -> None:
        body_ids = list(outcome.result.token_ids)
        if body_ids and body_ids[-1] in call.params.stop_token_ids:
            body_ids = body_ids[:-1]
        rollout.text_prefix = prompt_text + outcome.text
        rollout.text_prefix_ids = list(call.rendered.prompt_ids) + body_ids

    base = {"id": "cmpl-" + prepared[0][0].call_id, "created": int(time.time()), "model": model}
    if not stream:
        outcomes = await asyncio.gather(*(calls.complete(call) for call, _ in prepared))
        call, text = prepared[-1]
        remember(outcomes[-1], call, text)
        completion = sum(len(o.result.token_ids) for o in outcomes)
        prompt_tokens = sum(call.prompt_tokens for call, _ in prepared[::n])
        return web.json_response(
            {
                **base,
                "object": "text_completion",
                "system_fingerprint": f"policy-v{outcomes[0].result.policy_version}",
                "choices": [
                    _choice(o, i, text, echo, logprobs, request)
                    for i, (o, (_, text)) in enumerate(zip(outcomes, prepared, strict=True))
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                },
            }
        )

    ((call, text),) = prepared
    # Generation starts first, so the headers go out while the engine prefills.
    async with calls.stream(call) as items:
        response = await sse_start(request)
        if echo:
            await sse_send(
                response,
                {
                    **base,
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}],
                },
            )
        try:
            async for item in items:
                if isinstance(item, str):
                    chunk = {"index": 0, "text": item, "finish_reason": None, "logprobs": None}
                else:
                    remember(item, call, text)
                    finish = "length" if item.result.finish_reason == "length" else "stop"
                    chunk = {"index": 0, "text": "", "finish_reason": finish, "logprobs": None}
                await sse_send(response, {**base, "object": "text_completion", "choices": [chunk]})
                if usage and not isinstance(item, str):
                    done = len(item.result.token_ids)
                    counts = {
                        "prompt_tokens": call.prompt_tokens,
                        "completion_tokens": done,
                        "total_tokens": call.prompt_tokens + done,
                    }
                    await sse_send(
                        response, {**base, "object": "text_completion", "choices": [], "usage": counts}
                    )
        except ApplianceError as exc:
            error = {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}
            await sse_send(response, {"error": error})
    await sse_send(response, "[DONE]")
    await response.write_eof()
    return response


async def _nothing_sampled(
    request: web.Request,
    model: str,
    prompts: list[str | list[int]],
    n: int,
    echo: bool,
    logprobs: bool,
    stream: bool,
) -> web.StreamResponse:
    """``max_tokens: 0``: no call reaches the engine (nothing is sampled, so nothing is recorded);
    each choice is the prompt with ``echo``, else empty, cut at its length."""
    rollout, tokenizer = rollout_of(request), request.app[CALLS].tokenizer
    prompt_ids = [_prompt_ids(rollout, prompt, request) for prompt in prompts]
    texts = [
        p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(prompts, prompt_ids, strict=True)
    ]
    no_logprobs: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    choices = [
        {
            "index": i,
            "text": texts[i // n] if echo else "",
            "finish_reason": "length",
            "logprobs": no_logprobs if logprobs else None,
        }
        for i in range(len(prompts) * n)
    ]
    base = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    if stream:
        response = await sse_start(request)
        if echo:
            await sse_send(response, {**base, "choices": [{**choices[0], "finish_reason": None}]})
        await sse_send(response, {**base, "choices": [{**choices[0], "text": ""}]})
        await sse_send(response, "[DONE]")
        await response.write_eof()
        return response
    prompt_tokens = sum(map(len, prompt_ids))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    return web.json_response({**base, "choices": choices, "usage": usage})


def add_routes(app: web.Application) -> None:
    add_post(app, "/completions", completions)
