"""The OpenAI Chat Completions surface: ``POST /v1/chat/completions``, plain and streaming.

Owns the conversion between Chat Completions bodies and the call pipeline
(``appliance.proxy.pipeline``): request validation (each error names its parameter), the
``chat.completion`` object, and the ``chat.completion.chunk`` events with tool-call deltas and
``stream_options.include_usage``. ``response_format`` (json_object, json_schema) and a forced
``tool_choice`` (required, a named function) are enforced by constrained decoding. Pure: the
driver does the I/O and the tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from aiohttp import web

from appliance.chat.messages import assistant_to_openai, messages_from_openai, tools_from_openai
from appliance.proxy.driver import handler
from appliance.proxy.http import SLOT, JsonSlot, ProxySettings, add_post
from appliance.proxy.pipeline import Answer, CallRequest, ChatPrompt, Event, Started, TokenLogprob
from appliance.proxy.validate import (
    REASONING_EFFORTS,
    VERBOSITIES,
    fits_context,
    flag,
    forced_tool,
    include_usage,
    one_of,
    openai_fields,
    openai_metadata,
    openai_sampling,
    output_format,
    positive_int,
    refuse_distribution_changes,
    required_str,
    shown,
    stop_strings,
    top_logprobs,
)
from contracts.errors import ApplianceError, BadRequest

SURFACE = "openai.chat"
MAX_N = 16


def _unused_fields(body: dict[str, Any]) -> None:
    """The fields the appliance takes but does not act on (one tier, no reasoning or verbosity
    settings, nothing stored, text out only), checked as OpenAI checks them."""
    openai_fields(body)
    openai_metadata(body.get("metadata"))
    one_of(body.get("reasoning_effort"), "reasoning_effort", REASONING_EFFORTS)
    one_of(body.get("verbosity"), "verbosity", VERBOSITIES)
    flag(body, "store")
    flag(body, "parallel_tool_calls", True)
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
        raise BadRequest(
            "'modalities' must be a list of output types, of which only 'text' is served; "
            f"got {shown(modalities)}",
            param="modalities",
        )


class ChatSurface:
    name = SURFACE

    def parse(self, body: dict[str, Any], settings: ProxySettings) -> CallRequest:
        model = required_str(body, "model")
        stream = flag(body, "stream")
        usage = include_usage(body)
        n = positive_int(body, "n") or 1
        if n > MAX_N or (stream and n > 1):
            raise BadRequest(f"'n' must be at most {MAX_N} (1 when streaming)", param="n")
        logprobs = flag(body, "logprobs")
        top = top_logprobs(body, "top_logprobs")
        refuse_distribution_changes(body)
        _unused_fields(body)
        fmt = body.get("response_format")
        if fmt is not None and (
            not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")
        ):
            raise BadRequest(
                "'response_format.type' must be text, json_object or json_schema", param="response_format"
            )
        declared, tool_choice = _tools_and_choice(body)
        structure = forced_tool(tool_choice) or output_format(
            None if fmt is None else fmt.get("json_schema"), fmt, "response_format"
        )
        messages = messages_from_openai(body.get("messages"))
        tools = [] if tool_choice == "none" else declared
        legacy = positive_int(body, "max_tokens")  # deprecated by OpenAI; still checked
        max_tokens = positive_int(body, "max_completion_tokens") or legacy
        params = openai_sampling(
            settings, body, max_tokens=max_tokens, top_logprobs=(top or 0) if logprobs else 0
        )
        return CallRequest(
            surface=SURFACE,
            model=model,
            prompts=(ChatPrompt(tuple(messages), tuple(tools)),),
            params=params,
            body=body,
            stop=stop_strings(body, "stop"),
            n=n,
            stream=stream,
            logprobs=logprobs,
            include_usage=usage,
            structure=structure,
            fit_context=fits_context(settings, max_tokens),
            max_tokens_asked=max_tokens,
        )

    def whole(self, request: CallRequest, answers: Sequence[Answer]) -> dict[str, Any]:
        first = answers[0]
        completion = sum(a.completion_tokens for a in answers)
        return {
            "id": "chatcmpl-" + first.call_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "system_fingerprint": f"policy-v{first.policy_version}",
            "service_tier": "default",
            "choices": [
                {
                    "index": a.index,
                    "message": assistant_to_openai(a.message),
                    "finish_reason": _finish(a),
                    "logprobs": _logprobs(a) if request.logprobs else None,
                }
                for a in answers
            ],
            "usage": _usage(first.prompt_tokens, completion),
        }

    def encoder(self, request: CallRequest, started: Started) -> ChatChunks:
        (prompt,) = request.prompts
        tools = prompt.tools if isinstance(prompt, ChatPrompt) else ()
        return ChatChunks(request, started.call_id, hold_space=bool(tools))


class OpenAIStreamEnd:
    """How an OpenAI stream ends, chat or completions alike: an error after the headers went out
    is an ``error`` event, and the stream closes with ``[DONE]``."""

    def failed(self, error: ApplianceError) -> list[Event]:
        return [(None, {"error": error.openai_error()})]

    def trailer(self) -> list[Event]:
        return [(None, "[DONE]")]


class ChatChunks(OpenAIStreamEnd):
    """One streamed choice as ``chat.completion.chunk`` events, then ``[DONE]``."""

    def __init__(self, request: CallRequest, call_id: str, *, hold_space: bool = False) -> None:
        self.include_usage, self.logprobs = request.include_usage, request.logprobs
        # With tools declared, the text before a tool call loses its trailing whitespace: that
        # waits until more text follows (or the end), so the deltas add up to the final content.
        self.hold, self.held, self.sent = hold_space, "", ""
        self.base = {
            "id": "chatcmpl-" + call_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": request.model,
            "system_fingerprint": None,
        }
        #: A text delta's event, written once (False: not yet; None: not writable so).
        self._slot: JsonSlot | Literal[False] | None = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> Event:
        out = {
            **self.base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            out["usage"] = None
        return None, out

    def opening(self) -> list[Event]:
        return [self._chunk({"role": "assistant", "content": "", "refusal": None})]

    def text(self, delta: str) -> list[Event]:
        if self.hold:
            self.held += delta
            delta = self.held.rstrip()
            self.held = self.held[len(delta) :]
        self.sent += delta
        if not delta:
            return []
        if self._slot is False:
            self._slot = JsonSlot.of(self._chunk({"content": SLOT})[1])
        if self._slot is not None:
            return [(None, self._slot.fill(delta))]
        return [self._chunk({"content": delta})]

    def closing(self, answer: Answer) -> list[Event]:
        content = answer.message.content
        rest = content[len(self.sent) :] if content.startswith(self.sent) else ""
        events = [self._chunk({"content": rest})] if rest else []
        events += [
            self._chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ]
                }
            )
            for i, call in enumerate(answer.message.tool_calls)
        ]
        finish = self._chunk({}, _finish(answer))
        if self.logprobs:
            # The sampled tokens' log-probs, all in the last chunk: a client that adds up the
            # chunks' log-probs gets the whole list, as from the unstreamed answer.
            finish[1]["choices"][0]["logprobs"] = _logprobs(answer)
        events.append(finish)
        if self.include_usage:
            usage = _usage(answer.prompt_tokens, answer.completion_tokens)
            events.append((None, {**self.base, "choices": [], "usage": usage}))
        return events


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


def _finish(answer: Answer) -> str:
    if answer.message.tool_calls:
        return "tool_calls"
    return "length" if answer.truncated else "stop"


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _entry(entry: TokenLogprob | tuple[str, float]) -> dict[str, Any]:
    token, logprob = (entry.token, entry.logprob) if isinstance(entry, TokenLogprob) else entry
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _logprobs(answer: Answer) -> dict[str, Any]:
    content = [{**_entry(e), "top_logprobs": [_entry(t) for t in e.top]} for e in answer.logprobs or ()]
    return {"content": content, "refusal": None}


def add_routes(app: web.Application) -> None:
    add_post(app, "/chat/completions", handler(ChatSurface()))
