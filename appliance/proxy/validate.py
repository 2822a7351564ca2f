"""Validating request fields and turning them into sampling parameters.

Owns the small readers every surface uses for numbers, integers and strings (each raising
``BadRequest`` that names the parameter) and ``sampling_for``, which applies the appliance's
training-mode rules: the configured temperature replaces the client's, completion lengths are
capped. What the client asked stays in the recorded request.

Every number a surface reads is range-checked here, before anything reaches the engine: JSON
numbers arrive as Python ints of any size or floats that may be NaN or infinite (Python's json
reads ``NaN``, ``Infinity`` and ``1e999``), and booleans are not numbers. Where the spec says
integer, a float with an integral value (``5.0``, as some JSON encoders write every number) is
read as that integer, up to 2**53 (beyond it a float no longer holds every integer). The ranges
the engines themselves enforce (``appliance.engines.base``) are checked here first, so a bad
value is a 400 in the surface's shape, never an error in the middle of a stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.chat.constraints import require_finite
from appliance.engines.base import (
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from appliance.proxy.http import ProxySettings
from appliance.proxy.pipeline import Structure
from contracts.errors import BadRequest


def shown(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about client input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: The largest float magnitude read as an integer: every integer up to it is exact in a float.
_EXACT_FLOAT_INT = 2**53


def _integer(value: Any) -> int | None:
    """``value`` as an integer: an int (not a bool), or a float with an integral value of at most
    2**53 in magnitude; None for anything else (1.5, NaN, infinities, 1e308, strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT_INT:
        return int(value)
    return None


def number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    """A finite number in [lo, hi] (NaN and infinities fail the comparison); ``default`` if absent."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(
            f"'{name}' must be a number between {lo:g} and {hi:g}; got {shown(value)}", param=name
        )
    return float(value)


def positive_int(
    body: Mapping[str, Any], name: str, hi: int | None = None, lo: int = 1, param: str | None = None
) -> int | None:
    """An integer >= ``lo`` (1 unless given; and <= ``hi`` when given); None if absent. A 400
    names ``param`` (``name`` unless given: a nested field's dotted name)."""
    value = body.get(name)
    if value is None:
        return None
    read = _integer(value)
    if read is None or read < lo or (hi is not None and read > hi):
        bound = f" no larger than {hi}" if hi is not None else ""
        kind = "a positive integer" if lo == 1 else f"an integer of at least {lo}"
        param = param or name
        raise BadRequest(f"'{param}' must be {kind}{bound}; got {shown(value)}", param=param)
    return read


def optional_int(body: dict[str, Any], name: str, lo: int = SEED_MIN, hi: int = SEED_MAX) -> int | None:
    """An integer in [lo, hi] (by default any 64-bit signed integer); None if absent."""
    value = body.get(name)
    if value is None:
        return None
    read = _integer(value)
    if read is None or not lo <= read <= hi:
        raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}]; got {shown(value)}", param=name)
    return read


def seed(body: dict[str, Any], name: str = "seed") -> int | None:
    """A sampling seed: a 64-bit signed integer, what the engines' generators take."""
    return optional_int(body, name, SEED_MIN, SEED_MAX)


def top_logprobs(body: dict[str, Any], name: str) -> int | None:
    """How many alternatives per token to report: 0 to ``MAX_TOP_LOGPROBS``."""
    return optional_int(body, name, 0, MAX_TOP_LOGPROBS)


#: OpenAI's ranges for the penalties. Only 0 is served: see ``refuse_distribution_changes``.
PENALTIES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}

_POLICY = (
    "the appliance samples from the policy itself, as the trainer learns from it; "
    "this would change the sampled distribution"
)


def refuse_distribution_changes(body: dict[str, Any]) -> None:
    """Non-zero penalties and a non-empty ``logit_bias`` are refused, never ignored: either would
    change the distribution tokens are drawn from away from the policy the trainer learns from.
    Their defaults (0, ``{}``) are accepted; badly typed values are a 400 naming the field."""
    for name, (lo, hi) in PENALTIES.items():
        if number(body, name, 0.0, lo, hi) != 0.0:
            raise BadRequest(f"'{name}' is not supported ({_POLICY}); send 0 or leave it out", param=name)
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise BadRequest("'logit_bias' must be an object of token ids to numbers", param="logit_bias")
    if bias:
        raise BadRequest(f"'logit_bias' is not supported ({_POLICY}); leave it out", param="logit_bias")


def flag(body: Mapping[str, Any], name: str, default: bool = False, param: str | None = None) -> bool:
    """A boolean; ``default`` if absent or null. Anything else (0, "true") is a 400 naming
    ``param`` (``name`` unless given: a nested field's dotted name)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{param or name}' must be a boolean; got {shown(value)}", param=param or name)
    return value


def include_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage``: ``stream_options`` must be an object (or null) whose
    ``include_usage``, when given, is a boolean."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean", param="stream_options")
    return bool(usage)


def one_of(value: Any, param: str, allowed: tuple[str, ...]) -> str | None:
    """``value`` (read by the caller, ``param`` its name as the API names it, dotted where it is
    nested) if it is one of ``allowed`` or null; a 400 naming ``param`` otherwise."""
    if value is None or (isinstance(value, str) and value in allowed):
        return value
    raise BadRequest(
        f"Invalid value for '{param}': {shown(value)}; supported values are {', '.join(allowed)}",
        param=param,
    )


def optional_str(body: Mapping[str, Any], name: str, param: str | None = None) -> str | None:
    """A string or null (``param``: the name the 400 gives, ``name`` by default)."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{param or name}' must be a string; got {shown(value)}", param=param or name)
    return value


def member(body: Mapping[str, Any], name: str, param: str | None = None) -> Mapping[str, Any]:
    """An object field (empty if absent or null); a 400 naming ``param`` (``name``) otherwise."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadRequest(f"'{param or name}' must be an object; got {shown(value)}", param=param or name)
    return value


#: Values OpenAI's APIs take (its SDK's own lists) for the fields the appliance does not act on:
#: checked as OpenAI checks them, so a typo is a 400 naming the field, not silently ignored.
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")
CACHE_RETENTIONS = ("in_memory", "in-memory", "24h")


#: OpenAI's limits on ``metadata``: pairs, key length, value length.
METADATA_LIMITS = (16, 64, 512)


def openai_metadata(value: Any) -> dict[str, str]:
    """``metadata``: at most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    pairs, key_len, value_len = METADATA_LIMITS
    if not isinstance(value, dict) or len(value) > pairs:
        raise BadRequest(f"'metadata' must be an object of at most {pairs} pairs", param="metadata")
    for key, item in value.items():
        if len(key) > key_len or not isinstance(item, str) or len(item) > value_len:
            raise BadRequest(
                f"'metadata' maps keys of at most {key_len} characters to strings of at most "
                f"{value_len}; got {shown(key)}: {shown(item)}",
                param="metadata",
            )
    return value


def openai_fields(body: dict[str, Any]) -> None:
    """The fields Chat Completions and Responses both take and the appliance does not act on
    (the service tier, prompt caching, the end user's identifiers), checked as OpenAI does."""
    one_of(body.get("service_tier"), "service_tier", SERVICE_TIERS)
    one_of(body.get("prompt_cache_retention"), "prompt_cache_retention", CACHE_RETENTIONS)
    for name in ("prompt_cache_key", "safety_identifier", "user"):
        optional_str(body, name)


def required_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"'{name}' is required and must be a string", param=name)
    return value


def stop_strings(body: dict[str, Any], name: str) -> tuple[str, ...]:
    """``stop`` as a string or a list of up to 16 strings; empty strings are ignored, as OpenAI
    ignores them (an empty string would otherwise stop before the first token)."""
    value = body.get(name)
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values) or len(values) > 16:
        raise BadRequest(f"'{name}' must be a string or a list of up to 16 strings", param=name)
    return tuple(v for v in values if v)


def top_k(body: dict[str, Any]) -> int:
    """``top_k``: sample among the k most likely tokens (Anthropic's field; on the OpenAI surfaces
    the extension vLLM and other servers accept). 0 or absent is off, as is vLLM's -1."""
    value = optional_int(body, "top_k", -1, SEED_MAX)
    return 0 if value is None or value < 0 else value


def fits_context(settings: ProxySettings, max_tokens: int | None) -> bool:
    """Whether a call that asked for ``max_tokens`` (None: no limit given) gets what the context
    leaves: it gave none and the config sets no default."""
    return max_tokens is None and settings.max_tokens_default is None


def sampling_for(
    settings: ProxySettings,
    *,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    seed: int | None,
    top_logprobs: int = 0,
    top_k: int = 0,
) -> SamplingParams:
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(
            f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}; got {temperature!r}",
            param="temperature",
        )
    return SamplingParams(
        # Any size the client asks is capped (Python ints do not overflow; the cap is an int).
        max_tokens=min(
            (settings.max_tokens_default or settings.max_tokens_cap) if max_tokens is None else max_tokens,
            settings.max_tokens_cap,
        ),
        temperature=temperature if settings.temperature_override is None else settings.temperature_override,
        # top_p 0 (the spec allows it) keeps only the most likely token, as the smallest top_p
        # the engines take does: the most likely token alone already has probability >= 1/vocab.
        top_p=max(top_p, MIN_TOP_P),
        seed=seed,
        top_logprobs=top_logprobs,
        top_k=top_k,
    )


def openai_sampling(
    settings: ProxySettings, body: dict[str, Any], *, max_tokens: int | None, top_logprobs: int
) -> SamplingParams:
    """The sampling fields OpenAI's Chat Completions and Completions read alike: ``temperature``
    (0 to 2), ``top_p``, ``seed`` and vLLM's ``top_k``."""
    return sampling_for(
        settings,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed(body),
        top_logprobs=top_logprobs,
        top_k=top_k(body),
    )


def output_format(schema_holder: Any, fmt: Any, param: str) -> Structure | None:
    """The ``Structure`` a validated output format asks for: None for ``text`` (or none given),
    any JSON object for ``json_object``, JSON matching ``schema_holder["schema"]`` for
    ``json_schema`` (Chat Completions nests it under ``json_schema``, Responses puts it in the
    format itself)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return Structure("json_object")
    if kind != "json_schema":
        return None
    if not isinstance(schema_holder, dict):
        raise BadRequest(f"'{param}' of type json_schema needs its schema object", param=param)
    name = schema_holder.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"'{param}' json_schema needs a 'name'", param=param)
    schema = schema_holder.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest(f"'{param}' json_schema.schema must be an object", param=param)
    strict = schema_holder.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"'{param}' json_schema.strict must be a boolean", param=param)
    require_finite(schema, param, f"the '{param}' json_schema")
    return Structure("json_schema", schema=schema)


def forced_tool(choice: Any) -> Structure | None:
    """A validated ``tool_choice`` that forces a call: ``required`` (any declared tool, one or
    more calls) or a named function (exactly one call of it), in either API's object shape."""
    if choice == "required":
        return Structure("tool_call")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if isinstance(name, str):
            return Structure("tool_call", tool=name)
    return None
