"""Validating request fields and turning them into sampling parameters.

Owns the small readers every surface uses for numbers, integers and strings (each raising
``BadRequest`` that names the parameter) and ``sampling_for``, which applies the appliance's
training-mode rules: the configured temperature replaces the client's, completion lengths are
capped. What the client asked stays in the recorded request.

Every number a surface reads is range-checked here, before anything reaches the engine: JSON
numbers arrive as Python ints of any size or floats that may be NaN or infinite (Python's json
reads ``NaN``, ``Infinity`` and ``1e999``), and booleans are not numbers. The ranges the engines
themselves enforce (``appliance.engines.base``) are checked here first, so a bad value is a 400
in the surface's shape, never an error in the middle of a stream.
"""

from __future__ import annotations

from typing import Any

from appliance.engines.base import MAX_TOP_LOGPROBS, MIN_TEMPERATURE, SEED_MAX, SEED_MIN, SamplingParams
from appliance.errors import BadRequest
from appliance.proxy.http import ProxySettings


def shown(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about client input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def positive_int(body: dict[str, Any], name: str, hi: int | None = None) -> int | None:
    """An integer >= 1 (and <= ``hi`` when given); None if absent."""
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1 or (hi is not None and value > hi):
        bound = f" no larger than {hi}" if hi is not None else ""
        raise BadRequest(f"'{name}' must be a positive integer{bound}; got {shown(value)}", param=name)
    return int(value)


def optional_int(body: dict[str, Any], name: str, lo: int = SEED_MIN, hi: int = SEED_MAX) -> int | None:
    """An integer in [lo, hi] (by default any 64-bit signed integer); None if absent."""
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}]; got {shown(value)}", param=name)
    return int(value)


def seed(body: dict[str, Any], name: str = "seed") -> int | None:
    """A sampling seed: a 64-bit signed integer, what the engines' generators take."""
    return optional_int(body, name, SEED_MIN, SEED_MAX)


def top_logprobs(body: dict[str, Any], name: str) -> int | None:
    """How many alternatives per token to report: 0 to ``MAX_TOP_LOGPROBS``."""
    return optional_int(body, name, 0, MAX_TOP_LOGPROBS)


def ignored_numbers(body: dict[str, Any], ranges: dict[str, tuple[float, float]]) -> None:
    """Fields the proxy accepts and ignores (penalties, say) are still refused when out of range,
    as the upstream API refuses them."""
    for name, (lo, hi) in ranges.items():
        number(body, name, 0.0, lo, hi)


#: OpenAI's ranges for the penalties, accepted and ignored (the engine samples without them).
PENALTIES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def required_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"'{name}' is required and must be a string", param=name)
    return value


def stop_strings(body: dict[str, Any], name: str) -> tuple[str, ...]:
    """``stop`` as a string or a list of up to 4 non-empty strings."""
    value = body.get(name)
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values) or len(values) > 16:
        raise BadRequest(f"'{name}' must be a string or a list of non-empty strings", param=name)
    return tuple(values)


def sampling_for(
    settings: ProxySettings,
    *,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    seed: int | None,
    top_logprobs: int = 0,
) -> SamplingParams:
    if top_p <= 0.0:
        raise BadRequest("'top_p' must be greater than 0", param="top_p")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(
            f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}; got {temperature!r}",
            param="temperature",
        )
    return SamplingParams(
        # Any size the client asks is capped (Python ints do not overflow; the cap is an int).
        max_tokens=min(max_tokens or settings.max_tokens_default, settings.max_tokens_cap),
        temperature=temperature if settings.temperature_override is None else settings.temperature_override,
        top_p=top_p,
        seed=seed,
        top_logprobs=top_logprobs,
    )
