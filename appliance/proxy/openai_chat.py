"""The OpenAI Chat Completions surface: request validation and response shape.

Owns the conversion between ``POST /v1/chat/completions`` bodies and the internal call path
(``appliance.proxy.calls``). It validates what it reads and fails with ``BadRequest`` naming the
offending parameter; it never touches tokens itself.
"""

from __future__ import annotations

import time
from typing import Any

from appliance.chat.messages import assistant_to_openai, messages_from_openai, tools_from_openai
from appliance.engines.base import SamplingParams
from appliance.errors import BadRequest
from appliance.proxy.calls import CallOutcome

SURFACE = "openai.chat"


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be a number between {lo} and {hi}; got {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer; got {value!r}", param=name)
    return value


def parse_sampling(
    body: dict[str, Any], *, max_tokens_default: int, max_tokens_cap: int, temperature_override: float | None
) -> SamplingParams:
    """Sampling parameters from the request; in training mode the temperature is the configured one."""
    max_tokens = _integer(body, "max_completion_tokens") or _integer(body, "max_tokens") or max_tokens_default
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("'top_p' must be greater than 0", param="top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer; got {seed!r}", param="seed")
    return SamplingParams(
        max_tokens=min(max_tokens, max_tokens_cap),
        temperature=temperature if temperature_override is None else temperature_override,
        top_p=top_p,
        seed=seed,
    )


def parse_request(body: Any) -> tuple[dict[str, Any], list[Any], list[dict[str, Any]]]:
    """The validated body, its messages and its tools."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise BadRequest("'model' is required and must be a string", param="model")
    if body.get("stream"):
        raise BadRequest("streaming is not supported on this endpoint yet; send stream=false", param="stream")
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest("only n=1 is supported", param="n")
    return body, messages_from_openai(body.get("messages")), tools_from_openai(body.get("tools"))


def completion_body(outcome: CallOutcome, model: str) -> dict[str, Any]:
    message = outcome.message
    finish = outcome.result.finish_reason
    if message.tool_calls:
        finish = "tool_calls"
    completion_tokens = len(outcome.result.token_ids)
    return {
        "id": outcome.call_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"policy-v{outcome.result.policy_version}",
        "choices": [
            {"index": 0, "message": assistant_to_openai(message), "finish_reason": finish, "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": outcome.prompt_tokens + completion_tokens,
        },
    }
