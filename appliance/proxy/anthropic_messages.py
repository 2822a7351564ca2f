"""The Anthropic Messages surface: ``POST /v1/messages``, plain and streaming.

Owns the conversion between Anthropic Messages bodies and the call pipeline
(``appliance.proxy.pipeline``): request validation (each error names its parameter or content
block), the ``message`` object, the ``message_start`` ... ``message_stop`` events, and which
requests are answered with Anthropic's error shape (``ApplianceError.to_anthropic``). Pure: the
driver does the I/O and the tokens.

Conversion: ``system`` becomes a system message; ``text`` blocks become content (joined with
newlines, except in assistant turns); ``tool_use`` blocks become tool calls whose arguments are
``json.dumps(input, ensure_ascii=False)``, the text the proxy's tool parser produces, so a turn
sent back verbatim keys to the turn that was sampled and is spliced token for token. Each
``tool_result`` becomes a ``tool`` message, ahead of the turn's text. ``thinking`` blocks carry
a reasoning format's ``<think>`` text (not part of a turn's key). Other blocks are refused.

``top_k`` is honoured (the k most likely tokens, then top-p). Accepted and ignored:
``metadata`` and ``cache_control``. ``tool_choice`` ``any`` (one or more calls of any tool) and
``tool`` (one call of the named tool) are enforced by constrained decoding; ``none`` hides the
tools. A
final assistant turn (prefill) is refused: the chat template closes every assistant turn.

Streaming sends each block only as far as it is sure to be a prefix of the final block: with
tools declared, trailing whitespace waits (the text before tool calls loses its trailing
whitespace), so the text the SDK accumulates equals the non-streamed text block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from appliance.chat.messages import Message, ToolCall
from appliance.engines.base import SEED_MAX
from appliance.proxy import validate
from appliance.proxy.driver import handler
from appliance.proxy.http import ProxySettings, add_post, anthropic_client, json_body, rollout_of
from appliance.proxy.pipeline import Answer, CallRequest, ChatPrompt, Event, Started, Structure
from contracts.errors import ApplianceError, BadRequest

SURFACE = "anthropic.messages"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CHOICES = ("auto", "any", "tool", "none")
Blocks = list[dict[str, Any]]
#: ``stop_reason`` and ``stop_sequence``.
Stop = tuple[str | None, str | None]


def is_anthropic(request: web.Request) -> bool:
    """Whether errors on this request must take Anthropic's shape."""
    return request.path.endswith("/v1/messages") or anthropic_client(request)


def _blocks(content: Any, where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """Content as a list of blocks (a string is one text block), each with where it stands
    (``where[i]``, what its errors name)."""
    if isinstance(content, str):
        return [(f"{where}[0]", {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of content blocks", param=where)
    located = [(f"{where}[{i}]", block) for i, block in enumerate(content)]
    for at, block in located:
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{at} must be a content block with a 'type'", param=at)
    return located


def _unsupported(block: Mapping[str, Any], where: str, allowed: str) -> BadRequest:
    return BadRequest(
        f"{where}: content block type {block['type']!r} is not supported here (only {allowed})", param=where
    )


def _string(block: Mapping[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str) or (name != "text" and not value):
        raise BadRequest(f"{where}: a {block['type']} block needs a string '{name}'", param=where)
    return value


def _plain_text(content: Any, where: str) -> str:
    """Text-only content (system, tool results): text blocks joined with newlines."""
    texts: list[str] = []
    for at, block in _blocks(content, where):
        if block["type"] != "text":
            raise _unsupported(block, at, "text")
        texts.append(_string(block, "text", at))
    return "\n".join(texts)


def _user(content: Any, where: str) -> list[Message]:
    """One ``tool`` message per ``tool_result`` block, then the turn's text as a user message."""
    results: list[Message] = []
    texts: list[str] = []
    for at, block in _blocks(content, where):
        if block["type"] == "text":
            texts.append(_string(block, "text", at))
        elif block["type"] == "tool_result":
            use_id = _string(block, "tool_use_id", at)
            results.append(
                Message("tool", _plain_text(block.get("content") or "", f"{at}.content"), (), use_id)
            )
        else:
            raise _unsupported(block, at, "text and tool_result in user turns")
    if texts or not results:
        results.append(Message("user", "\n".join(texts)))
    return results


def _assistant(content: Any, where: str) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for at, block in _blocks(content, where):
        if block["type"] == "text":
            texts.append(_string(block, "text", at))
        elif block["type"] in ("thinking", "redacted_thinking"):
            thoughts.append(block["thinking"] if isinstance(block.get("thinking"), str) else "")
        elif block["type"] == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, Mapping):
                raise BadRequest(f"{at}: a tool_use block needs an object 'input'", param=at)
            text = json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(_string(block, "id", at), _string(block, "name", at), text))
        else:
            raise _unsupported(block, at, "text, thinking and tool_use in assistant turns")
    return Message("assistant", "".join(texts), tuple(calls), reasoning="\n".join(t for t in thoughts if t))


def to_messages(body: Mapping[str, Any]) -> list[Message]:
    """Validate and convert ``system`` and ``messages`` to internal messages."""
    out: list[Message] = []
    system = body.get("system")
    if system is not None and (text := _plain_text(system, "system")):
        out.append(Message("system", text))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(item, Mapping):
            raise BadRequest(f"{where} must be an object", param=where)
        if item.get("role") == "user":
            out.extend(_user(item.get("content"), f"{where}.content"))
        elif item.get("role") == "assistant":
            out.append(_assistant(item.get("content"), f"{where}.content"))
        else:
            raise BadRequest(
                f"{where}.role must be 'user' or 'assistant'; got {item.get('role')!r}", param=where
            )
    if out[-1].role == "assistant":
        raise BadRequest(
            "the last message must be a user turn: continuing an assistant turn (prefill) is not supported",
            param=f"messages[{len(raw) - 1}]",
        )
    return out


def to_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``tools`` as OpenAI-style function tools (what the chat template renders); [] for ``none``."""
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array", param="tools")
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise BadRequest(f"{at} must be a client tool (server tool {kind!r} is not available)", param=at)
        name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description")
        if not isinstance(name, str) or not name or not isinstance(schema, Mapping):
            raise BadRequest(f"{at} needs a 'name' and an object 'input_schema'", param=at)
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"{at}.description must be a string", param=at)
        described = {"description": description} if description is not None else {}
        tools.append(
            {"type": "function", "function": {"name": name, **described, "parameters": dict(schema)}}
        )
    choice = body.get("tool_choice")
    if choice is None:
        return tools
    if not isinstance(choice, Mapping) or choice.get("type") not in TOOL_CHOICES:
        raise BadRequest(f"'tool_choice.type' must be one of {', '.join(TOOL_CHOICES)}", param="tool_choice")
    if choice["type"] == "tool" and choice.get("name") not in {t["function"]["name"] for t in tools}:
        raise BadRequest("'tool_choice.name' must name a declared tool", param="tool_choice")
    return [] if choice["type"] == "none" else tools


#: Anthropic's values for the fields the appliance takes but does not act on.
SERVICE_TIERS = ("auto", "standard_only")
THINKING = ("enabled", "disabled", "adaptive")
#: The least ``thinking.budget_tokens`` Anthropic takes.
MIN_THINKING_BUDGET = 1024


def _unused_fields(body: dict[str, Any]) -> None:
    """The fields the appliance takes but does not act on (one tier, no extended thinking, the
    end user's id), checked as Anthropic checks them."""
    validate.one_of(body.get("service_tier"), "service_tier", SERVICE_TIERS)
    metadata = validate.member(body, "metadata")
    validate.optional_str(metadata, "user_id", "metadata.user_id")
    thinking = validate.member(body, "thinking")
    if thinking:
        kind = validate.one_of(thinking.get("type"), "thinking.type", THINKING)
        if kind is None:
            raise BadRequest(
                f"'thinking.type' is required: one of {', '.join(THINKING)}", param="thinking.type"
            )
        budget = validate.positive_int(
            thinking, "budget_tokens", lo=MIN_THINKING_BUDGET, param="thinking.budget_tokens"
        )
        if kind == "enabled" and budget is None:
            raise BadRequest(
                "'thinking.budget_tokens' is required when thinking is enabled", param="thinking"
            )


def _parse(body: dict[str, Any], settings: ProxySettings) -> CallRequest:
    model = validate.required_str(body, "model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    max_tokens = validate.positive_int(body, "max_tokens")
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required (a positive integer)", param="max_tokens")
    top_k = validate.optional_int(body, "top_k", 0, SEED_MAX) or 0
    if not isinstance(body.get("stop_sequences", []), list):
        raise BadRequest("'stop_sequences' must be an array of strings", param="stop_sequences")
    _unused_fields(body)
    messages, tools = to_messages(body), to_tools(body)
    params = validate.sampling_for(
        settings,
        max_tokens=max_tokens,
        temperature=validate.number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=validate.number(body, "top_p", 1.0, 0.0, 1.0),
        seed=None,
        top_k=top_k,
    )
    choice = body.get("tool_choice") or {}
    forced = None
    if tools and choice.get("type") == "any":
        forced = Structure("tool_call")
    elif tools and choice.get("type") == "tool":
        forced = Structure("tool_call", tool=choice["name"])
    return CallRequest(
        surface=SURFACE,
        model=model,
        prompts=(ChatPrompt(tuple(messages), tuple(tools)),),
        params=params,
        body=body,
        stop=validate.stop_strings(body, "stop_sequences"),
        stream=stream,
        structure=forced,
        max_tokens_asked=max_tokens,
    )


def _tool_use(call: ToolCall, args: Any) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": args,
    }


def to_content(message: Message) -> Blocks:
    """The assistant message as content blocks: its reasoning and text (if any), then its tool calls."""
    blocks: Blocks = []
    if message.reasoning:
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    return blocks + [_tool_use(c, json.loads(c.arguments)) for c in message.tool_calls]


def _stop(answer: Answer) -> Stop:
    """``stop_reason`` and the stop sequence that matched (the one the text was cut before)."""
    if answer.message.tool_calls:
        return "tool_use", None
    if answer.stop_sequence is not None:
        return "stop_sequence", answer.stop_sequence
    return ("max_tokens" if answer.truncated else "end_turn"), None


def _message(
    call_id: str, model: str, content: Blocks, stop: Stop, prompt: int, output: int
) -> dict[str, Any]:
    usage = {"input_tokens": prompt, "output_tokens": output}
    return {
        "id": "msg_" + call_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": {**usage, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def _event(kind: str, **data: Any) -> Event:
    return kind, {"type": kind, **data}


def _held(text: str, marker: str) -> str:
    """``text`` without a trailing partial ``marker`` (it may yet complete)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


class MessageEvents:
    """One call as Anthropic's events: ``message_start``, a thinking block (reasoning formats),
    a text block, the tool_use blocks, ``message_delta`` and ``message_stop``.

    Each block is sent only as far as it is sure to be a prefix of the final one (see the module
    docstring); ``closing`` sends what the outcome adds and closes the last block.
    """

    def __init__(self, started: Started, model: str, *, reasoning: bool, hold_space: bool) -> None:
        self.started, self.model = started, model
        self.reasoning, self.hold = reasoning, hold_space
        self.received = ""
        self.kinds: list[str] = []  # the blocks opened, by index
        self.sent: list[str] = []

    def opening(self) -> list[Event]:
        started = self.started
        message = _message(started.call_id, self.model, [], (None, None), started.prompt_tokens, 0)
        return [_event("message_start", message=message), _event("ping")]

    def text(self, delta: str) -> list[Event]:
        self.received += delta
        thought, text = "", self.received
        head = text.lstrip()
        if self.reasoning and (head.startswith(THINK_OPEN) or THINK_OPEN.startswith(head)):
            thought, closed, text = head[len(THINK_OPEN) :].partition(THINK_CLOSE)
            if not closed:
                thought = _held(thought, THINK_CLOSE)
            thought, text = thought.strip(), text.lstrip()
        return self._send("thinking", thought) + self._send("text", text.rstrip() if self.hold else text)

    def _send(self, kind: str, value: str) -> list[Event]:
        if not value:
            return []
        events: list[Event] = []
        if kind not in self.kinds:
            if self.kinds:
                events.append(_event("content_block_stop", index=len(self.kinds) - 1))
            block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            events.append(_event("content_block_start", index=len(self.kinds), content_block=block))
            self.kinds.append(kind)
            self.sent.append("")
        index = self.kinds.index(kind)
        sent = self.sent[index]
        if index == len(self.kinds) - 1 and len(value) > len(sent) and value.startswith(sent):
            delta = {"type": f"{kind}_delta", kind: value[len(sent) :]}
            events.append(_event("content_block_delta", index=index, delta=delta))
            self.sent[index] = value
        return events

    def closing(self, answer: Answer) -> list[Event]:
        message = answer.message
        events = self._send("thinking", message.reasoning) + self._send("text", message.content)
        if self.kinds:
            events.append(_event("content_block_stop", index=len(self.kinds) - 1))
        for i, tool_call in enumerate(message.tool_calls, start=len(self.kinds)):
            events.append(_event("content_block_start", index=i, content_block=_tool_use(tool_call, {})))
            delta = {"type": "input_json_delta", "partial_json": tool_call.arguments}
            events.append(_event("content_block_delta", index=i, delta=delta))
            events.append(_event("content_block_stop", index=i))
        reason, sequence = _stop(answer)
        end = {"stop_reason": reason, "stop_sequence": sequence}
        events.append(_event("message_delta", delta=end, usage={"output_tokens": answer.completion_tokens}))
        events.append(_event("message_stop"))
        return events

    def failed(self, error: ApplianceError) -> list[Event]:
        return [("error", error.to_anthropic())]

    def trailer(self) -> list[Event]:
        return []


class MessagesSurface:
    name = SURFACE

    def parse(self, body: dict[str, Any], settings: ProxySettings) -> CallRequest:
        return _parse(body, settings)

    def whole(self, request: CallRequest, answers: Sequence[Answer]) -> dict[str, Any]:
        (answer,) = answers
        return _message(
            answer.call_id,
            request.model,
            to_content(answer.message),
            _stop(answer),
            answer.prompt_tokens,
            answer.completion_tokens,
        )

    def encoder(self, request: CallRequest, started: Started) -> MessageEvents:
        (prompt,) = request.prompts
        tools = prompt.tools if isinstance(prompt, ChatPrompt) else ()
        return MessageEvents(started, request.model, reasoning=started.reasoning, hold_space=bool(tools))


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt's length as this model renders it (tools and
    system included). Nothing is generated or recorded."""
    body = await json_body(request)
    validate.required_str(body, "model")
    rendered = rollout_of(request).transcript.render_chat(to_messages(body), to_tools(body))
    return web.json_response({"input_tokens": len(rendered.prompt_ids)})


def add_routes(app: web.Application) -> None:
    add_post(app, "/messages", handler(MessagesSurface()))
    add_post(app, "/messages/count_tokens", count_tokens)
