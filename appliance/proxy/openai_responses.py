"""The OpenAI Responses surface: ``POST /v1/responses``, plain and streaming.

Owns the conversion between Responses bodies and the internal call path
(``appliance.proxy.calls``): ``instructions`` and ``input`` items (messages, ``function_call``,
``function_call_output``; ``reasoning`` items are dropped) become internal messages, function
tools become chat-style tool schemas, and the outcome becomes a ``response`` object (a message
item, then one ``function_call`` item per tool call) or its numbered event stream. As with
OpenAI, a completion cut at ``max_output_tokens`` is ``status: "incomplete"`` and its stream ends
with ``response.incomplete``; an error after the stream began is sent as an ``error`` event.

The proxy is stateless: it stores no responses, so ``previous_response_id`` and
``conversation`` are refused and the harness re-sends the whole history (openai-agents does).
Output items re-sent as input convert back to exactly the assistant message the proxy produced
(same text, same tool names and argument texts), so the earlier turn is spliced token for token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web

from appliance.chat.messages import Message, ToolCall, tools_from_openai
from appliance.errors import ApplianceError, BadRequest
from appliance.proxy.calls import CallOutcome, CallStream, PreparedCall
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
    number,
    positive_int,
    required_str,
    sampling_for,
    top_logprobs,
)

SURFACE = "openai.responses"
TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
#: Fields that refer to state stored by OpenAI; this proxy stores none.
STATEFUL = ("previous_response_id", "conversation")


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


def messages_from_input(instructions: Any, raw: Any) -> list[Message]:
    """``instructions`` plus ``input`` as internal messages.

    Consecutive ``function_call`` items, and an assistant message directly before them, make one
    assistant message with tool calls: the shape the proxy returned them in.
    """
    out: list[Message] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        out.append(Message(role="system", content=instructions))
    if isinstance(raw, str):
        return [*out, Message(role="user", content=raw)]
    if not isinstance(raw, list):
        raise BadRequest("'input' is required: a string or a list of input items", param="input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
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
    if not out:
        raise BadRequest("'input' must not be empty", param="input")
    return out


def tools_from_responses(raw: Any) -> list[dict[str, Any]]:
    """Responses function tools (flat) as the chat-style schemas the renderer shows the model."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array", param="tools")
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
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
    """``text.format``: text (the default), json_object or json_schema (accepted, not enforced)."""
    fmt = text.get("format") if isinstance(text, dict) else text
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'text.format.type' must be text, json_object or json_schema", param="text")
    return fmt


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


def _prepare(request: web.Request, body: dict[str, Any]) -> tuple[PreparedCall, bool, dict[str, Any]]:
    """Validate the body; returns the prepared call, the stream flag and the fields to echo."""
    model = required_str(body, "model")
    for name in STATEFUL:
        if body.get(name) is not None:
            raise BadRequest(
                f"'{name}' is not supported: this proxy is stateless and stores no responses; "
                "send the whole conversation in 'input' every turn",
                param=name,
            )
    stream = flag(body, "stream", False)
    parallel = flag(body, "parallel_tool_calls", True)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object", param="metadata")
    fmt = _text_format(body.get("text"))
    tool_choice = _tool_choice(body.get("tool_choice"))
    messages = messages_from_input(body.get("instructions"), body.get("input"))
    tools = tools_from_responses(body.get("tools"))
    max_output = positive_int(body, "max_output_tokens")
    top_logprobs(body, "top_logprobs")  # accepted, not returned (output_text logprobs stay empty)
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    params = sampling_for(
        request.app[SETTINGS], max_tokens=max_output, temperature=temperature, top_p=top_p, seed=None
    )
    call = request.app[CALLS].prepare(
        rollout_of(request),
        messages=messages,
        tools=[] if tool_choice == "none" else tools,
        params=params,
        surface=SURFACE,
        request=body,
        user_agent=user_agent(request),
    )
    echo = {
        "created_at": int(time.time()),
        "model": model,
        "instructions": body.get("instructions"),
        "metadata": metadata or {},
        "parallel_tool_calls": parallel,
        "temperature": temperature,
        "top_p": top_p,
        "tool_choice": tool_choice,
        "tools": [_function_tool(t) for t in body.get("tools") or []],
        "text": {"format": fmt},
        "max_output_tokens": max_output,
        "truncation": body.get("truncation") or "disabled",
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": "default",
        "store": False,
        "background": False,
        "user": body.get("user"),
    }
    return call, stream, echo


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def _shows_message(outcome: CallOutcome) -> bool:
    """The message item is left out only when the turn is tool calls without any text."""
    return bool(outcome.message.content) or not outcome.message.tool_calls


def _output(outcome: CallOutcome) -> list[dict[str, Any]]:
    message = outcome.message
    items = [_message_item("msg_" + outcome.call_id, message.content, "completed")]
    calls = [
        _call_item(f"fc_{outcome.call_id}_{i}", c, c.arguments, "completed")
        for i, c in enumerate(message.tool_calls)
    ]
    return (items if _shows_message(outcome) else []) + calls


def _response(
    call_id: str, echo: dict[str, Any], output: list[dict[str, Any]], outcome: CallOutcome | None
) -> dict[str, Any]:
    status, usage = "in_progress", None
    if outcome is not None:
        status = "incomplete" if outcome.result.finish_reason == "length" else "completed"
        generated = len(outcome.result.token_ids)
        usage = {
            "input_tokens": outcome.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + generated,
        }
    return {
        "id": "resp_" + call_id,
        "object": "response",
        **echo,
        "status": status,
        "completed_at": int(time.time()) if outcome is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "output": output,
        "usage": usage,
    }


async def responses(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    call, stream, echo = _prepare(request, body)
    if not stream:
        outcome = await request.app[CALLS].complete(call)
        return web.json_response(_response(call.call_id, echo, _output(outcome), outcome))
    # Generation starts first, so the headers and opening events go out while the engine prefills.
    async with request.app[CALLS].stream(call) as items:
        response = await sse_start(request)
        await _ResponseStream(request, response, call, echo).run(items)
    await response.write_eof()
    return response


class _ResponseStream:
    """Writes one call as the Responses event sequence, numbering every event."""

    def __init__(
        self, request: web.Request, response: web.StreamResponse, call: PreparedCall, echo: dict[str, Any]
    ) -> None:
        self.request, self.response, self.call, self.echo = request, response, call, echo
        self.sequence = 0
        self.message_id = "msg_" + call.call_id
        self.message_open = False
        self.sent = ""  # text sent as deltas

    async def send(self, kind: str, **fields: Any) -> None:
        await sse_send(self.response, {"type": kind, "sequence_number": self.sequence, **fields}, event=kind)
        self.sequence += 1

    async def open_message(self) -> None:
        if self.message_open:
            return
        self.message_open = True
        await self.send(
            "response.output_item.added",
            output_index=0,
            item=_message_item(self.message_id, None, "in_progress"),
        )
        await self.send(
            "response.content_part.added",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            part=_text_part(""),
        )

    async def delta(self, text: str) -> None:
        await self.open_message()
        await self.send(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )
        self.sent += text

    async def run(self, items: CallStream) -> None:
        started = _response(self.call.call_id, self.echo, [], None)
        await self.send("response.created", response=started)
        await self.send("response.in_progress", response=started)
        # With tools declared, the text before a tool call is returned stripped: hold whitespace
        # back at both ends so the deltas add up to the final text.
        strip = bool(self.call.tools)
        held = ""
        try:
            async for item in items:
                if isinstance(item, CallOutcome):
                    await self.finish(item)
                elif not strip:
                    await self.delta(item)
                else:
                    held = (held + item) if self.sent else (held + item).lstrip()
                    text = held.rstrip()
                    if text:
                        held = held[len(text) :]
                        await self.delta(text)
        except ApplianceError as exc:
            await self.send("error", code=exc.code, message=exc.message, param=exc.param)

    async def finish(self, outcome: CallOutcome) -> None:
        output: list[dict[str, Any]] = []
        content = outcome.message.content
        if self.message_open or _shows_message(outcome):
            await self.open_message()
            if content.startswith(self.sent) and len(content) > len(self.sent):
                await self.delta(content[len(self.sent) :])
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            await self.send("response.output_text.done", **where, text=content, logprobs=[])
            await self.send("response.content_part.done", **where, part=_text_part(content))
            output.append(_message_item(self.message_id, content, "completed"))
            await self.send("response.output_item.done", output_index=0, item=output[-1])
        for i, call in enumerate(outcome.message.tool_calls):
            index, item_id = len(output), f"fc_{outcome.call_id}_{i}"
            await self.send(
                "response.output_item.added",
                output_index=index,
                item=_call_item(item_id, call, "", "in_progress"),
            )
            where = {"item_id": item_id, "output_index": index}
            await self.send("response.function_call_arguments.delta", **where, delta=call.arguments)
            await self.send(
                "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
            )
            output.append(_call_item(item_id, call, call.arguments, "completed"))
            await self.send("response.output_item.done", output_index=index, item=output[-1])
        final = _response(outcome.call_id, self.echo, output, outcome)
        await self.send(f"response.{final['status']}", response=final)


def add_routes(app: web.Application) -> None:
    add_post(app, "/responses", responses)
