"""The OpenAI Responses surface: ``POST /v1/responses``, plain and streaming.

Owns the conversion between Responses bodies and the call pipeline
(``appliance.proxy.pipeline``): ``instructions`` and ``input`` items (messages, ``function_call``,
``function_call_output``; ``reasoning`` items are dropped) become internal messages, function
tools become chat-style tool schemas, and the outcome becomes a ``response`` object (a message
item, then one ``function_call`` item per tool call) or its numbered event stream, both shaped
by ``responses_output``. As with OpenAI, a completion cut at ``max_output_tokens`` is
``status: "incomplete"`` and its stream ends with ``response.incomplete``; an error after the
stream began is sent as an ``error`` event. Every field the response object repeats
(``truncation``, ``metadata``, ``user``, ...) is validated against the values the API allows,
so a client's ``Response`` model parses the answer.

As with OpenAI, a response is stored unless ``store`` is false (``response_store`` keeps it in
the rollout's events before the client hears it), and a request with ``previous_response_id``
continues that response's input items and output items (its ``instructions`` are not carried
over); ``conversation`` is refused. Output items, whether re-sent as input by the harness
(openai-agents does) or continued from a stored response, convert back to exactly the assistant
message the proxy produced (same text, same tool names and argument texts), so the earlier turn
is spliced token for token. The conversions are pure: the driver does the tokens, the handler at
the end the lookups in the stored responses (whose routes, ``GET`` and ``DELETE
/v1/responses/{id}``, ``response_store`` serves).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from appliance.chat.messages import Message, ToolCall, tool_array, tools_from_openai
from appliance.proxy import response_store
from appliance.proxy.bodies import read_conversation
from appliance.proxy.driver import serve
from appliance.proxy.http import ProxySettings, add_post, rollout_of
from appliance.proxy.pipeline import Answer, CallRequest, ChatPrompt, Started
from appliance.proxy.response_store import RESPONSES, PreviousResponseNotFound, input_items
from appliance.proxy.responses_output import ResponseEvents, output_items, response_object
from appliance.proxy.validate import (
    REASONING_EFFORTS,
    REASONING_SUMMARIES,
    VERBOSITIES,
    fits_context,
    flag,
    forced_tool,
    member,
    number,
    one_of,
    openai_fields,
    openai_metadata,
    output_format,
    positive_int,
    required_str,
    sampling_for,
    shown,
    top_logprobs,
)
from contracts.errors import BadRequest

SURFACE = "openai.responses"
TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
#: Fields that refer to state stored by OpenAI that this proxy does not keep.
STATEFUL = ("conversation",)
#: The ``include`` value that asks for the output text's log-probs.
LOGPROBS = "message.output_text.logprobs"
#: ``truncation``'s values (the response repeats it, and clients parse it as one of these).
TRUNCATIONS = ("auto", "disabled")


def _text(value: Any, where: str) -> str:
    """Message content or a tool output: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a string or a list of content parts", param=where)
    texts: list[str] = []
    for i, part in enumerate(value):
        part = part if isinstance(part, Mapping) else {}
        kind = part.get("type")
        text = part.get("refusal" if kind == "refusal" else "text")
        if kind not in (*TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise BadRequest(
                f"{where}[{i}]: only text content parts are supported (input_text, output_text); "
                f"got {kind!r}",
                param=where,
            )
        texts.append(text)
    return "".join(texts)


def _function_call(item: Mapping[str, Any], where: str) -> ToolCall:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise BadRequest(f"{where}: a function_call needs string 'call_id' and 'name'", param=where)
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=call_id, name=name, arguments=arguments)


def messages_from_input(
    instructions: Any, raw: Any, earlier: Sequence[Mapping[str, Any]] = ()
) -> list[Message]:
    """``instructions``, then the ``earlier`` items a ``previous_response_id`` continues, then
    ``input``, as internal messages.

    Consecutive ``function_call`` items, and an assistant message directly before them, make one
    assistant message with tool calls: the shape the proxy returned them in.
    """
    out: list[Message] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        out.append(Message(role="system", content=instructions))
    _read_items(out, earlier, "previous_response_id")
    if isinstance(raw, str):
        return [*out, Message(role="user", content=raw)]
    if not isinstance(raw, list):
        raise BadRequest("'input' is required: a string or a list of input items", param="input")
    _read_items(out, raw, "input")
    if not out:
        raise BadRequest("'input' must not be empty", param="input")
    return out


def _read_items(out: list[Message], items: Sequence[Any], name: str) -> None:
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if not isinstance(item, Mapping):
            raise BadRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = MESSAGE_ROLES.get(str(item.get("role")))
            if role is None:
                roles = ", ".join(MESSAGE_ROLES)
                raise BadRequest(
                    f"{where}.role must be one of {roles}; got {item.get('role')!r}", param=where
                )
            out.append(Message(role=role, content=_text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1].role == "assistant":
                out[-1] = replace(out[-1], tool_calls=(*out[-1].tool_calls, call))
            else:
                out.append(Message(role="assistant", tool_calls=(call,)))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}: a function_call_output needs a string 'call_id'", param=where)
            content = _text(item.get("output"), f"{where}.output")
            out.append(Message(role="tool", content=content, tool_call_id=call_id))
        elif kind != "reasoning":
            raise BadRequest(
                f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                "function_call_output and reasoning are)",
                param=where,
            )


def tools_from_responses(raw: Any) -> list[dict[str, Any]]:
    """Responses function tools (flat) as the chat-style schemas the renderer shows the model."""
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(tool_array(raw)):
        tool = tool if isinstance(tool, Mapping) else {}
        kind = tool.get("type")
        if kind != "function":
            raise BadRequest(
                f"tools[{i}]: tool type {kind!r} is not supported; only 'function' tools are",
                param=f"tools[{i}]",
            )
        for field, kind, what in (
            ("description", str, "a string"),
            ("parameters", dict, "an object"),
            ("strict", bool, "a boolean"),
        ):
            if tool.get(field) is not None and not isinstance(tool[field], kind):
                raise BadRequest(f"tools[{i}].{field} must be {what}", param=f"tools[{i}]")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat.append({"type": "function", "function": function})
    return tools_from_openai(chat)


def _tool_choice(value: Any) -> Any:
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return dict(value)
    raise BadRequest(
        '\'tool_choice\' must be auto, none, required or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def _text_format(text: Any) -> dict[str, Any]:
    """``text.format``: text (the default), json_object or json_schema (enforced by constrained
    decoding)."""
    fmt = text.get("format") if isinstance(text, dict) else text
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'text.format.type' must be text, json_object or json_schema", param="text")
    if fmt.get("description") is not None and not isinstance(fmt["description"], str):
        raise BadRequest("'text.format.description' must be a string", param="text")
    return fmt


def _unused_fields(body: dict[str, Any]) -> int | None:
    """The fields the appliance takes but does not act on (it runs no built-in tools, answers in
    the foreground, has one tier and no reasoning settings), checked as OpenAI checks them;
    ``max_tool_calls`` (a count, or None), which the response repeats."""
    openai_fields(body)
    flag(body, "background")
    reasoning = member(body, "reasoning")
    one_of(reasoning.get("effort"), "reasoning.effort", REASONING_EFFORTS)
    for name in ("summary", "generate_summary"):
        one_of(reasoning.get(name), f"reasoning.{name}", REASONING_SUMMARIES)
    one_of(member(body, "text").get("verbosity"), "text.verbosity", VERBOSITIES)
    options = member(body, "stream_options")
    flag(options, "include_obfuscation", param="stream_options.include_obfuscation")
    return positive_int(body, "max_tool_calls", lo=0)


def _truncation(value: Any) -> str:
    if value is None:
        return "disabled"
    if value not in TRUNCATIONS:
        raise BadRequest(f"'truncation' must be auto or disabled; got {shown(value)}", param="truncation")
    return str(value)


def _echoed_str(body: dict[str, Any], name: str) -> str | None:
    """An optional string field the response repeats."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string; got {shown(value)}", param=name)
    return value


def _function_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A declared function tool as the response shows it: the Responses API's ``FunctionTool``
    (``strict`` defaults to true there), not the request's object echoed verbatim."""
    out: dict[str, Any] = {
        "type": "function",
        "name": tool["name"],
        "parameters": tool.get("parameters"),
        "strict": True if tool.get("strict") is None else tool["strict"],
    }
    if tool.get("description") is not None:
        out["description"] = tool["description"]
    return out


def _parse(
    body: dict[str, Any], settings: ProxySettings, earlier: Sequence[Mapping[str, Any]] = ()
) -> CallRequest:
    """Validate the body (``earlier``: the items its ``previous_response_id`` continues); the
    fields a response object repeats travel in ``options["echo"]``, whether to keep the response
    in ``options["store"]``."""
    model = required_str(body, "model")
    for name in STATEFUL:
        if body.get(name) is not None:
            raise BadRequest(
                f"'{name}' is not supported: this proxy keeps no conversations; chain responses "
                "with 'previous_response_id' or send the whole conversation in 'input'",
                param=name,
            )
    stream = flag(body, "stream", False)
    store = flag(body, "store", True)
    previous = _echoed_str(body, "previous_response_id")
    parallel = flag(body, "parallel_tool_calls", True)
    metadata = openai_metadata(body.get("metadata"))
    fmt = _text_format(body.get("text"))
    max_tool_calls = _unused_fields(body)
    tool_choice = _tool_choice(body.get("tool_choice"))
    messages = messages_from_input(body.get("instructions"), body.get("input"), earlier)
    tools = tools_from_responses(body.get("tools"))
    max_output = positive_int(body, "max_output_tokens")
    top = top_logprobs(body, "top_logprobs")
    logprobs = LOGPROBS in _include(body.get("include"))
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    params = sampling_for(
        settings,
        max_tokens=max_output,
        temperature=temperature,
        top_p=top_p,
        seed=None,
        top_logprobs=(top or 0) if logprobs else 0,
    )
    echo = {
        "created_at": int(time.time()),
        "model": model,
        "instructions": body.get("instructions"),
        "metadata": metadata,
        "parallel_tool_calls": parallel,
        "temperature": temperature,
        "top_p": top_p,
        "tool_choice": tool_choice,
        "tools": [_function_tool(t) for t in body.get("tools") or []],
        "text": {"format": fmt},
        "max_output_tokens": max_output,
        "max_tool_calls": max_tool_calls,
        "top_logprobs": top,
        "truncation": _truncation(body.get("truncation")),
        "previous_response_id": previous,
        "reasoning": None,
        "service_tier": "default",
        "background": False,
        "user": _echoed_str(body, "user"),
    }
    return CallRequest(
        surface=SURFACE,
        model=model,
        prompts=(ChatPrompt(tuple(messages), tuple([] if tool_choice == "none" else tools)),),
        params=params,
        body=body,
        stream=stream,
        logprobs=logprobs,
        options={"echo": echo, "store": store},
        fit_context=fits_context(settings, max_output),
        max_tokens_asked=max_output,
        structure=forced_tool(tool_choice) or output_format(fmt, fmt, "text"),
    )


def _include(value: Any) -> list[str]:
    """``include``: a list of strings (what else to return); only ``LOGPROBS`` changes anything
    here (the other values name outputs of OpenAI's hosted tools, which the proxy has none of)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest("'include' must be an array of strings", param="include")
    return value


class ResponsesSurface:
    """The surface for one request: ``earlier`` are the items its ``previous_response_id``
    continues; a response object, once made (to be stored), is the one answered."""

    name = SURFACE

    def __init__(self, earlier: Sequence[Mapping[str, Any]] = ()) -> None:
        self.earlier = earlier
        self.answered: dict[str, dict[str, Any]] = {}

    def parse(self, body: dict[str, Any], settings: ProxySettings) -> CallRequest:
        return _parse(body, settings, self.earlier)

    def response(self, request: CallRequest, answer: Answer) -> dict[str, Any]:
        """The finished response object of ``answer`` (made once)."""
        made = self.answered.get(answer.call_id)
        if made is None:
            made = response_object(answer.call_id, request.options["echo"], output_items(answer), answer)
            self.answered[answer.call_id] = made
        return made

    def whole(self, request: CallRequest, answers: Sequence[Answer]) -> dict[str, Any]:
        (answer,) = answers
        return self.response(request, answer)

    def encoder(self, request: CallRequest, started: Started) -> ResponseEvents:
        (prompt,) = request.prompts
        tools = prompt.tools if isinstance(prompt, ChatPrompt) else ()
        echo = request.options["echo"]
        return ResponseEvents(started.call_id, echo, hold_space=bool(tools), answered=self.answered)


async def _create(request: web.Request) -> web.StreamResponse:
    rollout = rollout_of(request)  # a wrong key is a 401 whatever the body holds
    # A stateless conversation sends its whole input again: read from where the last one ended.
    body = read_conversation(await request.read(), rollout.transcript.body, "input")
    responses = request.app[RESPONSES]
    earlier: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise BadRequest(
                f"'previous_response_id' must be a string; got {shown(previous)}",
                param="previous_response_id",
            )
        found = await responses.context(rollout.rollout, previous)
        if found is None:
            raise PreviousResponseNotFound(previous)
        earlier = found
    surface = ResponsesSurface(earlier)

    async def keep(call_request: CallRequest, answers: Sequence[Answer]) -> None:
        if call_request.options["store"]:
            (answer,) = answers
            made = surface.response(call_request, answer)
            await responses.keep(rollout.rollout, made, input_items(body["input"], answer.call_id))

    return await serve(request, surface, rollout, body, keep)


def add_routes(app: web.Application) -> None:
    """``POST /v1/responses`` and the stored responses' routes."""
    response_store.add_routes(app)
    add_post(app, "/responses", _create)
