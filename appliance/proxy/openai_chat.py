"""The OpenAI Chat Completions surface: ``POST /v1/chat/completions``, plain and streaming.

Owns the conversion between Chat Completions bodies and the internal call path
(``appliance.proxy.calls``): request validation (each error names its parameter), the
``chat.completion`` object, and the ``chat.completion.chunk`` stream with tool-call deltas and
``stream_options.include_usage``. It never touches tokens itself.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from appliance.chat.messages import assistant_to_openai, messages_from_openai, tools_from_openai
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
    positive_int,
    refuse_distribution_changes,
    required_str,
    sampling_for,
    seed,
    shown,
    stop_strings,
    top_logprobs,
)

SURFACE = "openai.chat"
MAX_N = 16


def _prepare(request: web.Request, body: dict[str, Any]) -> tuple[list[PreparedCall], bool, bool, bool]:
    """Validate the body; returns one prepared call per choice, and stream/usage/logprobs flags."""
    required_str(body, "model")
    stream = flag(body, "stream")
    usage = include_usage(body)
    n = positive_int(body, "n") or 1
    if n > MAX_N or (stream and n > 1):
        raise BadRequest(f"'n' must be at most {MAX_N} (1 when streaming)", param="n")
    logprobs = flag(body, "logprobs")
    top = top_logprobs(body, "top_logprobs")
    refuse_distribution_changes(body)
    fmt = body.get("response_format")
    if fmt is not None and (
        not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")
    ):
        raise BadRequest(
            "'response_format.type' must be text, json_object or json_schema", param="response_format"
        )
    declared, tool_choice = _tools_and_choice(body)
    messages = messages_from_openai(body.get("messages"))
    tools = [] if tool_choice == "none" else declared
    max_tokens = positive_int(body, "max_tokens")  # deprecated by OpenAI; still checked
    params = sampling_for(
        request.app[SETTINGS],
        max_tokens=positive_int(body, "max_completion_tokens") or max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed(body),
        top_logprobs=(top or 0) if logprobs else 0,
    )
    stop = stop_strings(body, "stop")
    rollout = rollout_of(request)
    calls = request.app[CALLS]
    prepared = [
        calls.prepare(
            rollout,
            messages=messages,
            tools=tools,
            params=params,
            surface=SURFACE,
            request=body,
            user_agent=user_agent(request),
            stop=stop,
        )
        for _ in range(n)
    ]
    return prepared, stream, usage, logprobs


def _tools_and_choice(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The declared tools and ``tool_choice``, validated. The deprecated ``functions`` and
    ``function_call`` are read as the ``tools`` and ``tool_choice`` they stand for, so the model
    sees a function exactly as it would the equivalent tool."""
    functions, function_call = body.get("functions"), body.get("function_call")
    raw_tools, choice = body.get("tools"), body.get("tool_choice")
    if functions is not None:
        if raw_tools is not None:
            raise BadRequest("give 'tools' or the deprecated 'functions', not both", param="functions")
        if not isinstance(functions, list):
            raise BadRequest("'functions' must be an array", param="functions")
        raw_tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None:
        if choice is not None:
            raise BadRequest(
                "give 'tool_choice' or the deprecated 'function_call', not both", param="function_call"
            )
        if function_call in ("none", "auto"):
            choice = function_call
        elif isinstance(function_call, dict) and isinstance(function_call.get("name"), str):
            choice = {"type": "function", "function": {"name": function_call["name"]}}
        else:
            raise BadRequest(
                f"'function_call' must be none, auto or {{\"name\": ...}}; got {shown(function_call)}",
                param="function_call",
            )
    try:
        tools = tools_from_openai(raw_tools)
    except BadRequest as exc:
        if functions is None:
            raise
        raise BadRequest(exc.message.replace("tools[", "functions["), param="functions") from None
    if choice is None or choice in ("auto", "none", "required"):
        return tools, choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest(
            'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}; '
            f"got {shown(choice)}",
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise BadRequest(f"'tool_choice' names {name!r}, which is not a declared tool", param="tool_choice")
    return tools, choice


def _finish(outcome: CallOutcome) -> str:
    if outcome.message.tool_calls:
        return "tool_calls"
    return "length" if outcome.result.finish_reason == "length" else "stop"


def _usage(outcome: CallOutcome) -> dict[str, Any]:
    completion = len(outcome.result.token_ids)
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": outcome.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _logprobs(outcome: CallOutcome, request: web.Request) -> dict[str, Any]:
    tokenizer = request.app[CALLS].tokenizer

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    result = outcome.result
    tops = result.top_logprobs or tuple(() for _ in result.token_ids)
    content = [
        {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
        for token, logprob, top in zip(result.token_ids, result.logprobs, tops, strict=True)
    ]
    return {"content": content, "refusal": None}


def _body(outcomes: list[CallOutcome], model: str, request: web.Request, logprobs: bool) -> dict[str, Any]:
    first = outcomes[0]
    usage = _usage(first)
    usage["completion_tokens"] = sum(len(o.result.token_ids) for o in outcomes)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {
        "id": "chatcmpl-" + first.call_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"policy-v{first.result.policy_version}",
        "service_tier": "default",
        "choices": [
            {
                "index": i,
                "message": assistant_to_openai(o.message),
                "finish_reason": _finish(o),
                "logprobs": _logprobs(o, request) if logprobs else None,
            }
            for i, o in enumerate(outcomes)
        ],
        "usage": usage,
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    prepared, stream, include_usage, logprobs = _prepare(request, body)
    calls = request.app[CALLS]
    if not stream:
        outcomes = await asyncio.gather(*(calls.complete(p) for p in prepared))
        return web.json_response(_body(list(outcomes), body["model"], request, logprobs))

    (call,) = prepared
    base = {
        "id": "chatcmpl-" + call.call_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body["model"],
        "system_fingerprint": None,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    # Generation starts first, so the headers and the role chunk go out while the engine prefills.
    # Leaving the block early (the client went away) cancels the generation.
    async with calls.stream(call) as items:
        response = await sse_start(request)
        await sse_send(response, chunk({"role": "assistant", "content": "", "refusal": None}))
        try:
            async for item in items:
                if isinstance(item, str):
                    await sse_send(response, chunk({"content": item}))
                    continue
                for i, tool_call in enumerate(item.message.tool_calls):
                    delta = {
                        "index": i,
                        "id": tool_call.id,
                        "type": "function",
                        "function": {"name": tool_call.name, "arguments": tool_call.arguments},
                    }
                    await sse_send(response, chunk({"tool_calls": [delta]}))
                await sse_send(response, chunk({}, _finish(item)))
                if include_usage:
                    await sse_send(response, {**base, "choices": [], "usage": _usage(item)})
        except ApplianceError as exc:
            # The status line is gone already: the error travels as an event, as OpenAI sends it.
            error = {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}
            await sse_send(response, {"error": error})
    await sse_send(response, "[DONE]")
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    add_post(app, "/chat/completions", chat_completions)
