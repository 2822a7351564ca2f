"""The grammar builders: what their grammars let a sampler write, walked token by token over the
tiny model's real vocabulary, and what ``parse_assistant`` makes of it."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from appliance.chat import constraints
from appliance.chat.schemas import no_finite_value
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.tools import parse_assistant
from appliance.engines.constraints import Constraint, GrammarCompiler
from contracts.errors import BadRequest

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"$ref": "#/$defs/small"},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
            "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
}
ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 5}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
#: A function declared without parameters takes any object.
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [ADD, ECHO, PING]


def conforms(value: Any, schema: Mapping[str, Any]) -> bool:
    """Whether ``value`` matches ``schema``, for the few keywords these tests' schemas use."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", math.inf)
    if kind == "object":
        properties = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(key in value for key in schema.get("required", ()))
            and (schema.get("additionalProperties", True) is not False or set(value) <= set(properties))
            and all(conforms(value[key], sub) for key, sub in properties.items() if key in value)
        )
    raise AssertionError(f"conforms() does not know {schema}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path, tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_model_dir(tiny_model_dir, tokenizer.vocab_size, tokenizer.im_end_id)


@pytest.fixture(scope="module")
def closers(tokenizer: Tokenizer) -> frozenset[int]:
    """Tokens that may end a JSON string, object or array."""
    return frozenset(t for t in range(tokenizer.vocab_size) if any(c in tokenizer.decode([t]) for c in '"}]'))


def walk(
    compiler: GrammarCompiler,
    constraint: Constraint,
    stop: int,
    seed: int,
    closers: frozenset[int],
    limit: int = 120,
) -> list[int]:
    """Tokens drawn at random among those the grammar allows, until the stop id (included).

    Half the draws are uniform; the other half prefer the stop id, else a token that closes
    something, so that walks through unbounded strings still end well within ``limit``."""
    rng = random.Random(seed)
    guide = compiler.guide(constraint, [stop])
    tokens: list[int] = []
    while len(tokens) < limit:
        allowed = guide.allowed().nonzero().flatten().tolist()
        closing = [t for t in allowed if t in closers]
        if rng.random() < 0.5:
            token = rng.choice(allowed)
        else:
            token = stop if stop in allowed else rng.choice(closing or allowed)
        tokens.append(token)
        if token == stop:
            return tokens
        guide.consume(token)
    raise AssertionError(f"the walk did not end within {limit} tokens: {tokens}")


def accepts(compiler: GrammarCompiler, constraint: Constraint, tokenizer: Tokenizer, text: str) -> bool:
    """Whether ``text`` (tokenized as the model would write it) is a complete match."""
    matcher = compiler.matcher(constraint.grammar)
    return bool(matcher.consume_tokens(tokenizer.encode(text))) and bool(matcher.is_accepting())


def sampled_text(tokenizer: Tokenizer, tokens: list[int]) -> str:
    assert tokens[-1] == tokenizer.im_end_id
    return tokenizer.decode(tokens[:-1])


def test_json_object_is_any_compact_object(
    compiler: GrammarCompiler, tokenizer: Tokenizer, closers: frozenset[int]
) -> None:
    constraint = constraints.json_object()
    assert constraint.kind == "json_object"
    for seed in range(30):
        value = json.loads(
            sampled_text(tokenizer, walk(compiler, constraint, tokenizer.im_end_id, seed, closers))
        )
        assert isinstance(value, dict)
    assert accepts(compiler, constraint, tokenizer, '{"a": [1, {"b": null}], "c": "x"}')
    assert not accepts(compiler, constraint, tokenizer, "[1, 2]")
    assert not accepts(compiler, constraint, tokenizer, '{"a":1}')  # not the compact form


def test_json_schema_output_validates(
    compiler: GrammarCompiler, tokenizer: Tokenizer, closers: frozenset[int]
) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "s": {"enum": ["x", "y"]},
            "t": {"type": "string", "maxLength": 4},
        },
        "required": ["n", "s", "t"],
        "additionalProperties": False,
    }
    constraint = constraints.json_schema(schema)
    assert constraint.kind == "json_schema"
    for seed in range(30):
        text = sampled_text(tokenizer, walk(compiler, constraint, tokenizer.im_end_id, seed, closers))
        assert conforms(json.loads(text), schema)
    assert not accepts(compiler, constraint, tokenizer, '{"n": 100, "s": "x", "t": ""}')


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "minProperties": 3, "maxProperties": 1},
        {"type": "string", "pattern": "("},
        {"type": "no-such-type"},
    ],
)
def test_an_unusable_schema_is_a_bad_request(schema: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as caught:
        constraints.json_schema(schema)
    assert caught.value.param == "response_format"


def test_a_forced_function_is_called_exactly_once(
    compiler: GrammarCompiler, tokenizer: Tokenizer, closers: frozenset[int]
) -> None:
    constraint = constraints.tool_call(TOOLS, "add")
    assert constraint.kind == "tool_call"
    # ADD's parameters with the reference resolved.
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -99, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    for seed in range(30):
        text = sampled_text(tokenizer, walk(compiler, constraint, tokenizer.im_end_id, seed, closers))
        message = parse_assistant(text, {"add", "echo", "ping"})
        assert [call.name for call in message.tool_calls] == ["add"], text
        assert conforms(json.loads(message.tool_calls[0].arguments), schema)
        assert message.content == ""


def test_the_tool_call_tags_are_the_tokens_the_model_writes(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    text = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
    assert tokenizer.token_id("<tool_call>") is not None and tokenizer.token_id("<tool_call") is None
    as_tokens = constraints.tool_call(TOOLS, "echo")
    assert accepts(compiler, as_tokens, tokenizer, text)
    # The same text with the tags spelled in pieces, as a model without the tag tokens writes it.
    spelled = [
        tokenizer.encode(piece) for piece in ("<", "tool", "_", "call", ">", "</", "tool", "_", "call", ">")
    ]
    assert all(len(ids) == 1 for ids in spelled)
    inner = tokenizer.encode('\n{"name": "echo", "arguments": {"text": "hi"}}\n')
    pieces = [*(ids[0] for ids in spelled[:5]), *inner, *(ids[0] for ids in spelled[5:])]
    assert tokenizer.decode(pieces) == text
    assert not compiler.matcher(as_tokens.grammar).consume_tokens(pieces)
    as_text = constraints.tool_call(TOOLS, "echo", tags_are_tokens=False)
    matcher = compiler.matcher(as_text.grammar)
    assert matcher.consume_tokens(pieces) and matcher.is_accepting()


def test_required_calls_any_declared_tools(
    compiler: GrammarCompiler, tokenizer: Tokenizer, closers: frozenset[int]
) -> None:
    constraint = constraints.tool_call(TOOLS, None)
    names: set[str] = set()
    counts: set[int] = set()
    for seed in range(60):
        text = sampled_text(
            tokenizer, walk(compiler, constraint, tokenizer.im_end_id, seed, closers, limit=400)
        )
        message = parse_assistant(text, {"add", "echo", "ping"})
        assert message.tool_calls, text
        names.update(call.name for call in message.tool_calls)
        counts.add(len(message.tool_calls))
    assert names == {"add", "echo", "ping"}
    assert max(counts) > 1
    two = (
        '<tool_call>\n{"name": "ping", "arguments": {"x": [1]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "echo", "arguments": {"text": "a"}}\n</tool_call>'
    )
    assert accepts(compiler, constraint, tokenizer, two)
    assert not accepts(compiler, constraint, tokenizer, "")


def test_tool_choice_must_name_a_declared_tool() -> None:
    with pytest.raises(BadRequest) as caught:
        constraints.tool_call(TOOLS, "missing")
    assert caught.value.param == "tool_choice"
    with pytest.raises(BadRequest):
        constraints.tool_call([], None)
    with pytest.raises(BadRequest) as caught:
        constraints.tool_call(
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "f"
        )
    assert caught.value.param == "tools[0]"


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            "# requires property 'a', and #/properties/a refers to '#'",
        ),
        ({"$ref": "#"}, "# refers to '#'"),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "# requires at least 1 items"),
        ({"anyOf": [{"$ref": "#"}]}, "# has no branch of anyOf"),
        (
            {
                "$defs": {
                    "n": {
                        "type": "object",
                        "properties": {"next": {"$ref": "#/$defs/n"}},
                        "required": ["next"],
                    }
                },
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/n"}},
                "required": ["x"],
            },
            "#/$defs/n/properties/next refers to '#/$defs/n'",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/properties/b"}, "b": {"$ref": "#/properties/a"}},
                "required": ["a"],
            },
            "#/properties/b refers to '#/properties/a'",
        ),
    ],
)
def test_a_schema_no_finite_value_matches_is_a_bad_request_naming_the_recursion(
    schema: dict[str, Any], why: str
) -> None:
    assert why in (no_finite_value(schema) or "")
    with pytest.raises(BadRequest) as caught:
        constraints.json_schema(schema)
    assert caught.value.param == "response_format"
    assert "no finite JSON value" in caught.value.message and why in caught.value.message
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            # An object schema as the parameters themselves (its references stay right).
            "parameters": schema
            if schema.get("type") == "object"
            else {"type": "object", "properties": {"v": schema}, "required": ["v"]},
        },
    }
    with pytest.raises(BadRequest) as caught:
        constraints.tool_call([tool], "f")
    assert caught.value.param == "tools[0]"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # a may be left out
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {
            "type": "object",
            "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["a"],
        },
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {
            "$defs": {
                "tree": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
                    "required": ["kids"],
                }
            },
            "$ref": "#/$defs/tree",
        },
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/missing"}},
            "required": ["a"],
        },  # llguidance's
    ],
)
def test_a_recursive_schema_with_a_finite_value_is_accepted(schema: dict[str, Any]) -> None:
    assert no_finite_value(schema) is None


@pytest.mark.parametrize("index", ["\u00b2", "\u2460", "9" * 5000, "1"])
def test_a_ref_indexing_an_array_with_other_digits_is_not_an_error(index: str) -> None:
    """``#/$defs/l/²``: a digit to ``str.isdigit`` that ``int`` refuses names nothing (an
    unresolved reference, left to the grammar compiler), never a server error."""
    schema = {
        "$defs": {"l": [{"type": "string"}]},
        "type": "object",
        "properties": {"a": {"$ref": f"#/$defs/l/{index}"}},
    }
    assert no_finite_value(schema) is None
