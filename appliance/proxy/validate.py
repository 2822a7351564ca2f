"""Validating request fields and turning them into sampling parameters.

Owns the small readers every surface uses for numbers, integers and strings (each raising
``BadRequest`` that names the parameter) and ``sampling_for``, which applies the appliance's
training-mode rules: the configured temperature replaces the client's, completion lengths are
capped. What the client asked stays in the recorded request.
"""

from __future__ import annotations

from typing import Any

from appliance.engines.base import SamplingParams
from appliance.errors import BadRequest
from appliance.proxy.http import ProxySettings


def number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be a number between {lo:g} and {hi:g}; got {value!r}", param=name)
    return float(value)


def positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer; got {value!r}", param=name)
    return value


def optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be an integer; got {value!r}", param=name)
    return value


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
    return SamplingParams(
        max_tokens=min(max_tokens or settings.max_tokens_default, settings.max_tokens_cap),
        temperature=temperature if settings.temperature_override is None else settings.temperature_override,
        top_p=top_p,
        seed=seed,
        top_logprobs=top_logprobs,
    )
