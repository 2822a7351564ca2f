"""The one driver of model calls: every surface's request runs through the same steps.

Owns what happens between a surface's ``parse`` and its shapes: reading the body, rendering
each prompt on the rollout's transcript, preparing one call per choice, then either waiting for
every choice (a whole response) or streaming the single choice as server-sent events: headers
while the engine prefills, the surface's opening events, text deltas, the closing events once
the call is durable, an error event if the call fails after the headers went out (an
unexpected exception included, logged), the surface's trailer (``[DONE]``) and the end of the
stream. Decoding token ids to the log-prob entries surfaces show is done here too, so a surface
never sees a token id, and so is turning a required output form (``Structure``) into the grammar
the engine enforces. A surface that keeps state (stored Responses) calls ``serve`` with a
``keep`` step, which gets the finished answers once they are durable and before any is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from appliance.chat import constraints
from appliance.chat.messages import reading_conversation
from appliance.chat.template import TOOL_CALL_OPEN
from appliance.chat.tokenizer import Tokenizer
from appliance.engines.constraints import Constraint
from appliance.proxy.bodies import read_conversation
from appliance.proxy.calls import CallOutcome, CallService, PreparedCall
from appliance.proxy.http import (
    CALLS,
    SETTINGS,
    DirectChunks,
    Handler,
    json_answer,
    rollout_of,
    sse_events,
    sse_start,
    user_agent,
)
from appliance.proxy.pipeline import (
    Answer,
    CallRequest,
    ChatPrompt,
    Started,
    Structure,
    Surface,
    TokenLogprob,
)
from appliance.proxy.refusals import note as note_refusal
from appliance.rollouts.registry import ActiveRollout
from contracts.errors import ApplianceError

log = logging.getLogger(__name__)


#: What a surface that keeps state does with a call's finished answers before any of them is
#: sent (makes them durable: a client never holds an id the log does not).
Keep = Callable[[CallRequest, Sequence[Answer]], Awaitable[None]]


def handler(surface: Surface) -> Handler:
    """The aiohttp handler that serves ``surface``'s model calls."""

    async def handle(request: web.Request) -> web.StreamResponse:
        rollout = rollout_of(request)  # a wrong key is a 401 whatever the body holds
        # A conversation's body is read from where its last one ended, where it repeats it.
        body = read_conversation(await request.read(), rollout.transcript.body)
        return await serve(request, surface, rollout, body)

    return handle


async def serve(
    request: web.Request,
    surface: Surface,
    rollout: ActiveRollout,
    body: dict[str, Any],
    keep: Keep | None = None,
) -> web.StreamResponse:
    """One model-call request of ``rollout``, its ``body`` read: parse, generate, answer."""
    # The messages this rollout's last request held are taken from it, not read again.
    with reading_conversation(rollout.transcript.messages):
        call_request = surface.parse(body, request.app[SETTINGS])
    calls = request.app[CALLS]
    prepared = prepare(calls, rollout, call_request, user_agent(request))
    if not call_request.stream:
        if len(prepared) == 1:
            outcomes = [await calls.complete(prepared[0][0])]
        else:
            outcomes = await asyncio.gather(*(calls.complete(call) for call, _ in prepared))
        answers = [
            answer(calls.tokenizer, call_request, call, outcome, i, prompt_index)
            for i, ((call, prompt_index), outcome) in enumerate(zip(prepared, outcomes, strict=True))
        ]
        if keep is not None:
            await keep(call_request, answers)
        return json_answer(surface.whole(call_request, answers))
    ((call, _),) = prepared
    return await _stream(request, surface, call_request, call, keep)


def prepare(
    calls: CallService, rollout: ActiveRollout, request: CallRequest, agent: str
) -> list[tuple[PreparedCall, int]]:
    """One prepared call per choice (``n`` per prompt, prompt-major), each with its prompt's index.
    Every prompt is rendered once, before anything is generated."""
    prepared: list[tuple[PreparedCall, int]] = []
    for index, prompt in enumerate(request.prompts):
        if isinstance(prompt, ChatPrompt):
            rendered, tools = rollout.transcript.render_chat(prompt.messages, prompt.tools), prompt.tools
        else:
            rendered, tools = rollout.transcript.render_text(prompt), ()
        params = request.params
        if request.structure is not None:
            params = replace(params, constraint=constraint_for(request.structure, tools, calls.tokenizer))
        for _ in range(request.n):
            call = calls.prepare(
                rollout,
                rendered,
                tools=tools,
                params=params,
                surface=request.surface,
                request=request.body,
                user_agent=agent,
                stop=request.stop,
                prompt_logprobs=request.prompt_logprobs,
                fit_context=request.fit_context,
                asked_max_tokens=request.max_tokens_asked,
            )
            prepared.append((call, index))
    return prepared


def constraint_for(structure: Structure, tools: Sequence[dict[str, Any]], tokenizer: Tokenizer) -> Constraint:
    """The grammar the engine enforces for ``structure`` (``BadRequest`` if it cannot be built,
    e.g. a schema the grammar library refuses), before anything is generated."""
    if structure.kind == "json_object":
        return constraints.json_object()
    if structure.kind == "json_schema":
        return constraints.json_schema(structure.schema or {})
    tags_are_tokens = tokenizer.token_id(TOOL_CALL_OPEN) is not None
    return constraints.tool_call(tools, structure.tool, tags_are_tokens=tags_are_tokens)


async def _stream(
    request: web.Request,
    surface: Surface,
    call_request: CallRequest,
    call: PreparedCall,
    keep: Keep | None = None,
) -> web.StreamResponse:
    calls = request.app[CALLS]
    reasoning = call.rollout.transcript.fmt.reasoning
    started = Started(call.call_id, call.prompt_tokens, call.rendered.text, reasoning)
    encoder = surface.encoder(call_request, started)
    # Generation starts first, so the headers and opening events go out while the engine
    # prefills. Leaving the block early (the client went away) cancels the generation, which is
    # recorded as cancelled.
    # The closing events (or the error's), the trailer and the end of the stream go out in one
    # write, after the call is durable.
    last = b""
    async with calls.stream(call) as items:
        response = await sse_start(request)
        await response.write(sse_events(encoder.opening()))
        chunks = DirectChunks.of(request, response)
        if chunks is not None:
            # While this task waits for tokens, the engine's callback writes each group's text
            # itself (one task switch fewer per group), as long as the client keeps up.
            items.write_through(chunks.ready, lambda text: chunks.write(sse_events(encoder.text(text))))
        try:
            async for item in items:
                if isinstance(item, str):
                    await response.write(sse_events(encoder.text(item)))
                else:
                    done = answer(calls.tokenizer, call_request, call, item)
                    if keep is not None:
                        await keep(call_request, [done])
                    last = sse_events(encoder.closing(done))
        except ApplianceError as exc:
            # The status line is gone already: the error travels as an event.
            note_refusal(request, exc)
            last += sse_events(encoder.failed(exc))
        except ConnectionError:
            raise  # the client went away; nothing to answer
        except Exception:
            log.exception("unhandled error while streaming %s", request.path)
            internal = ApplianceError("internal error; see the appliance log")
            note_refusal(request, internal)
            last += sse_events(encoder.failed(internal))
    await response.write_eof(last + sse_events(encoder.trailer()))
    return response


def answer(
    tokenizer: Tokenizer,
    request: CallRequest,
    call: PreparedCall,
    outcome: CallOutcome,
    index: int = 0,
    prompt_index: int = 0,
) -> Answer:
    """The outcome as a surface renders it, its log-probs decoded if the request asked."""
    result = outcome.result
    logprobs = prompt_logprobs = None
    if request.logprobs:
        tops = result.top_logprobs or tuple(() for _ in result.token_ids)
        logprobs = tuple(
            _entry(tokenizer, token, logprob, top)
            for token, logprob, top in zip(result.token_ids, result.logprobs, tops, strict=True)
        )
    if request.prompt_logprobs is not None:
        ids = call.rendered.prompt_ids
        values = result.prompt_logprobs or tuple(None for _ in ids)
        tops = result.prompt_top_logprobs or tuple(() for _ in ids)
        prompt_logprobs = tuple(
            _entry(tokenizer, token, logprob, top)
            for token, logprob, top in zip(ids, values, tops, strict=True)
        )
    return Answer(
        index=index,
        prompt_index=prompt_index,
        call_id=outcome.call_id,
        message=outcome.message,
        text=outcome.text,
        finish_reason=result.finish_reason,
        stop_sequence=outcome.stop_sequence,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=len(result.token_ids),
        policy_version=result.policy_version,
        prompt_text=call.rendered.text,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _entry(
    tokenizer: Tokenizer, token: int, logprob: float | None, top: Sequence[tuple[int, float]]
) -> TokenLogprob:
    return TokenLogprob(
        token=tokenizer.decode([token]),
        logprob=logprob,
        top=tuple((tokenizer.decode([t]), lp) for t, lp in top),
    )
