"""The OpenAI Completions surface: ``POST /v1/completions`` on text or token-id prompts.

Owns the legacy completions shape: prompts as a string, a list of token ids, or a batch of
either; ``n`` choices per prompt; ``echo`` (with ``logprobs``, the prompt's tokens are scored
too: the first has no log-prob, as OpenAI answers); ``logprobs``; ``stop``; streaming for one
prompt and one choice. No chat template is applied. An empty text prompt starts from the
document separator; ``max_tokens: 0`` samples nothing (the prompt alone with ``echo``), as
OpenAI answers it. A text prompt that continues this rollout's previous prompt + completion
continues its exact ids (``appliance.chat.transcript``). Pure: the driver does the I/O.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from aiohttp import web

from appliance.proxy.driver import handler
from appliance.proxy.http import SLOT, JsonSlot, ProxySettings, add_post
from appliance.proxy.openai_chat import OpenAIStreamEnd
from appliance.proxy.pipeline import Answer, CallRequest, Event, Started, TextPrompt, TokenLogprob
from appliance.proxy.validate import (
    fits_context,
    flag,
    include_usage,
    openai_sampling,
    optional_int,
    positive_int,
    refuse_distribution_changes,
    required_str,
    stop_strings,
)
from contracts.errors import BadRequest

SURFACE = "openai.completions"
MAX_CHOICES = 16
#: OpenAI's limits: ``best_of`` 0 to 20 (served only as 0 or equal to ``n``, the two that ask
#: for no candidates beyond the choices returned: each choice is sampled once), and up to 5
#: alternatives per token in ``logprobs``.
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


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompts(value: Any) -> list[TextPrompt]:
    if isinstance(value, str):
        return [value]
    if _is_ids(value):
        return [tuple(value)]
    if isinstance(value, list) and value:
        out: list[TextPrompt] = []
        for item in value:
            if isinstance(item, str):
                out.append(item)
            elif _is_ids(item):
                out.append(tuple(item))
            else:
                raise BadRequest(
                    "'prompt' items must be strings or non-empty lists of token ids", param="prompt"
                )
        return out
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those", param="prompt")


class CompletionsSurface:
    name = SURFACE

    def parse(self, body: dict[str, Any], settings: ProxySettings) -> CallRequest:
        model = required_str(body, "model")
        prompts = _prompts(body.get("prompt"))
        n = positive_int(body, "n") or 1
        stream = flag(body, "stream")
        usage = include_usage(body)
        if len(prompts) * n > MAX_CHOICES or (stream and len(prompts) * n > 1):
            raise BadRequest(f"at most {MAX_CHOICES} prompts x n (1 when streaming)", param="n")
        echo = flag(body, "echo")
        logprobs = optional_int(body, "logprobs", 0, MAX_LOGPROBS)
        best_of = positive_int(body, "best_of", MAX_BEST_OF, lo=0)
        if best_of not in (None, 0, n):
            raise BadRequest(
                f"'best_of' {best_of} is not supported: each choice is sampled once and returned, so "
                f"best_of must equal n ({n}), be 0, or be left out",
                param="best_of",
            )
        _refuse_suffix(body)
        max_tokens = positive_int(body, "max_tokens", lo=0)
        refuse_distribution_changes(body)
        params = openai_sampling(settings, body, max_tokens=max_tokens, top_logprobs=logprobs or 0)
        return CallRequest(
            surface=SURFACE,
            model=model,
            prompts=tuple(prompts),
            params=params,
            body=body,
            stop=stop_strings(body, "stop"),
            n=n,
            stream=stream,
            logprobs=logprobs is not None,
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
            include_usage=usage,
            options={"echo": echo},
            fit_context=fits_context(settings, max_tokens),
            max_tokens_asked=max_tokens,
        )

    def whole(self, request: CallRequest, answers: Sequence[Answer]) -> dict[str, Any]:
        echo = bool(request.options.get("echo"))
        completion = sum(a.completion_tokens for a in answers)
        prompt_tokens = sum(a.prompt_tokens for a in answers[:: request.n])
        return {
            "id": "cmpl-" + answers[0].call_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model,
            "system_fingerprint": f"policy-v{answers[0].policy_version}",
            "choices": [_choice(a, echo, request.logprobs) for a in answers],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        }

    def encoder(self, request: CallRequest, started: Started) -> CompletionChunks:
        echo = started.prompt_text if request.options.get("echo") else None
        return CompletionChunks(request, started.call_id, echo)


def _finish(answer: Answer) -> str:
    return "length" if answer.truncated else "stop"


def _choice(answer: Answer, echo: bool, logprobs: bool) -> dict[str, Any]:
    prompt_text = answer.prompt_text or ""
    choice: dict[str, Any] = {
        "index": answer.index,
        "text": (prompt_text if echo else "") + answer.text,
        "finish_reason": _finish(answer),
        "logprobs": None,
    }
    if logprobs:
        entries = [*(answer.prompt_logprobs or ()), *(answer.logprobs or ())]
        offsets, at = [], 0 if answer.prompt_logprobs is not None or not echo else len(prompt_text)
        for entry in entries:
            offsets.append(at)
            at += len(entry.token)
        choice["logprobs"] = {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # One object per token even with logprobs 0 (then each is empty), as OpenAI sends;
            # the first prompt token has none (null).
            "top_logprobs": [
                _top(e, i == 0 and answer.prompt_logprobs is not None) for i, e in enumerate(entries)
            ],
            "text_offset": offsets,
        }
    return choice


def _top(entry: TokenLogprob, first_prompt_token: bool) -> dict[str, float] | None:
    return None if first_prompt_token else dict(entry.top)


class CompletionChunks(OpenAIStreamEnd):
    """One streamed choice as ``text_completion`` events (the echoed prompt first), then ``[DONE]``."""

    def __init__(self, request: CallRequest, call_id: str, echo: str | None) -> None:
        self.request, self.echo = request, echo
        self.base = {
            "id": "cmpl-" + call_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model,
        }
        #: A text delta's event, written once (False: not yet; None: not writable so).
        self._slot: JsonSlot | Literal[False] | None = False

    def _chunk(self, text: str, finish: str | None = None) -> Event:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return None, {**self.base, "choices": [choice]}

    def opening(self) -> list[Event]:
        return [self._chunk(self.echo)] if self.echo else []

    def text(self, delta: str) -> list[Event]:
        if self._slot is False:
            self._slot = JsonSlot.of(self._chunk(SLOT)[1])
        if self._slot is not None:
            return [(None, self._slot.fill(delta))]
        return [self._chunk(delta)]

    def closing(self, answer: Answer) -> list[Event]:
        events = [self._chunk("", _finish(answer))]
        if self.request.include_usage:
            usage = {
                "prompt_tokens": answer.prompt_tokens,
                "completion_tokens": answer.completion_tokens,
                "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            }
            events.append((None, {**self.base, "choices": [], "usage": usage}))
        return events


def add_routes(app: web.Application) -> None:
    add_post(app, "/completions", handler(CompletionsSurface()))
