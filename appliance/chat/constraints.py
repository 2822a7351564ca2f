"""Grammars for OpenAI's structured outputs: ``response_format`` and a forced ``tool_choice``.

Owns turning what a client asks for into a ``Constraint`` (``appliance.engines.constraints``):
an llguidance Lark grammar over the assistant's sampled text, which every engine enforces. It
knows the hermes tool-call format the renderer writes and ``appliance.chat.tools`` parses, so a
``tool_call`` grammar only produces text that ``parse_assistant`` turns into tool calls.

JSON is compact and canonical: ``", "`` between items, ``": "`` after keys, no other whitespace,
as ``json.dumps`` writes it (and as the template renders tool-call arguments). Free whitespace
would let a model pad its output until ``max_tokens`` without ever breaking the grammar.

A grammar covers the whole sampled text, up to the stop token: there is no room for reasoning
before it. A reasoning format (qwen3 writes ``<think>...</think>`` first) therefore answers a
constrained call without thinking; a proxy that wants both renders the generation prompt with
the thought already closed (an empty ``<think>\\n\\n</think>\\n\\n``, as Qwen3's own template does
with thinking off), so that the constrained text is the answer alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from appliance.chat.schemas import no_finite_value
from appliance.chat.template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from appliance.engines.constraints import Constraint, check_constraint
from contracts.errors import BadRequest

#: llguidance's JSON options (``x-guidance``): the compact form ``json.dumps`` writes.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_rule(schema: Mapping[str, Any], param: str) -> str:
    """``%json {...}``: text matching ``schema``, compact unless the schema says otherwise."""
    body = {**schema}
    body.setdefault("x-guidance", COMPACT_JSON)
    try:
        return "%json " + json.dumps(body, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"the schema is not JSON: {exc}", param=param) from exc


def require_finite(schema: Mapping[str, Any], param: str, what: str) -> None:
    """``BadRequest`` naming ``param`` when no finite JSON value matches ``schema`` (a recursion
    that never ends): llguidance compiles it, then fails once the answer has started."""
    reason = no_finite_value(schema)
    if reason is not None:
        raise BadRequest(
            f"{what} has no finite JSON value, so no answer can match it: {reason} (a value would "
            "need another inside it without end); make the recursion optional: leave the property "
            'out of "required", or give it a branch that ends (e.g. anyOf with {"type": "null"})',
            param=param,
        )


def _checked(constraint: Constraint, param: str) -> Constraint:
    """``constraint`` if its grammar compiles, else ``BadRequest`` naming ``param``."""
    try:
        check_constraint(constraint)
    except BadRequest as exc:
        raise BadRequest(exc.message, param=param) from exc
    return constraint


def json_object() -> Constraint:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return _checked(
        Constraint("json_object", "start: " + _json_rule({"type": "object"}, "response_format")),
        "response_format",
    )


def json_schema(schema: Mapping[str, Any]) -> Constraint:
    """JSON matching ``schema`` (``response_format: {"type": "json_schema", "json_schema":
    {"schema": ...}}``); ``BadRequest`` (param "response_format") if llguidance cannot compile it."""
    if not isinstance(schema, Mapping):
        raise BadRequest("json_schema.schema must be an object", param="response_format")
    require_finite(schema, "response_format", "the json_schema")
    return _checked(
        Constraint("json_schema", "start: " + _json_rule(schema, "response_format")), "response_format"
    )


def tool_call(
    tools: Sequence[Mapping[str, Any]], name: str | None, *, tags_are_tokens: bool = True
) -> Constraint:
    """Tool calls in the hermes format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    ``tools`` are OpenAI function tools (``appliance.chat.messages.tools_from_openai``); each
    call's arguments match its function's ``parameters`` schema. ``name`` None is
    ``tool_choice: "required"``: one or more calls (separated by a newline) of any declared tool;
    a name is a forced function: exactly one call of it. ``tags_are_tokens``: the tokenizer has
    ``<tool_call>`` and ``</tool_call>`` as single tokens (the Qwen families, the tiny model;
    ``tokenizer.token_id(TOOL_CALL_OPEN) is not None``), which the grammar then names, since that
    is how the model writes them; else the tags are spelled as text. It must be True where the
    tokens exist: llguidance's mask offers the tag token for the spelled tags, then refuses it.
    """
    schemas: dict[str, Mapping[str, Any]] = {}
    index: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tools[{i}] needs a function with a name", param=f"tools[{i}]")
        parameters = fn.get("parameters")
        parameters = {"type": "object"} if parameters is None else parameters
        if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
            raise BadRequest(f"tools[{i}].function.parameters must be an object schema", param=f"tools[{i}]")
        schemas[fn["name"]] = {"type": "object", **parameters}
        index[fn["name"]] = i
    if name is not None and name not in schemas:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    if not schemas:
        raise BadRequest("tool_choice requires a tool call, but no tools are declared", param="tool_choice")
    called = [name] if name is not None else list(schemas)
    if tags_are_tokens:
        open_tag, close_tag = TOOL_CALL_OPEN, TOOL_CALL_CLOSE
    else:
        open_tag, close_tag = json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)
    lines = [
        "start: call" if name is not None else 'start: call ("\\n" call)*',
        f'call: {open_tag} "\\n" payload "\\n" {close_tag}',
        "payload: " + " | ".join(f"fn_{i}" for i in range(len(called))),
    ]
    for i, fn_name in enumerate(called):
        require_finite(schemas[fn_name], f"tools[{index[fn_name]}]", f"the parameters of tool {fn_name!r}")
        arguments = dict(schemas[fn_name])
        # References ("#/$defs/...") resolve against the root, which the payload now is.
        definitions: dict[str, Any] = {
            k: arguments.pop(k) for k in ("$defs", "definitions") if k in arguments
        }
        payload: dict[str, Any] = {
            "type": "object",
            "properties": {"name": {"const": fn_name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            **definitions,
        }
        lines.append(f"fn_{i}: " + _json_rule(payload, "tools"))
    return _checked(Constraint("tool_call", "\n".join(lines) + "\n"), "tools")
