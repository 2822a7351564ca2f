"""Every request field of every surface at its type's extremes (hypothesis, fixed budget).

Where ``test_fuzz`` mutates bodies with arbitrary JSON, this fuzzer aims at the edges of each
type, field by field: integers one past 64 bits (2**63, -2**63 - 1) and beyond (a 4001-digit
number, one of 5000 digits Python refuses to read), NaN, +-Infinity, 1e308, -0.0, denormals,
empty and 1 MB strings, lone surrogates, nesting 90, 150 and 10,000 levels deep, and values of
the wrong type (booleans, null, arrays, objects). Each example sets one to three fields (nested
ones too: a message's role or content) of a valid body, streamed or not, and sends it to one
appliance (tiny model, real torch engine, real store) served from a background thread.

For every example: no 5xx but a retryable 503 ``engine_unavailable`` or a 429; an error has the
surface's shape; a refused call records nothing; a stream carries no server error; an answer
holds no NaN or Infinity unless the request put one in a field that is echoed. Afterwards the
appliance still serves a call, nothing is held (the gate's ``inflight``, the admission's
``held``), and a training step completes.

The default suite runs ``EXAMPLES`` per surface (~5 s for all four on a 2-core machine: most
examples are refused before the engine); the ``slow`` marker runs ``SLOW_EXAMPLES`` per surface
with the same body (~20 s).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from appliance.app import Appliance
from appliance.rollouts.registry import ActiveRollout
from tests.appliance.proxy.test_fuzz import Served
from tests.support import make_config

EXAMPLES = 400
SLOW_EXAMPLES = 2000


def budget(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        # No shrinking: against a live server it can take minutes; the failing example is printed.
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    config = make_config(
        tmp_path_factory.mktemp("extremes"), tiny_model_dir, max_tokens=2, max_tokens_cap=3, max_steps=1
    )
    with Served(Appliance(config)) as served:
        yield served


@pytest.fixture(scope="module")
def rollout(served: Served) -> ActiveRollout:
    return served.call(lambda: served.app.registry.register("extremes", task_id="t", group="g", task={}))


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.app.proxy_url, timeout=60.0) as http:
        yield http


# -- values at the edges of each type -----------------------------------------------------------

#: Stand-ins replaced in the encoded body by text ``json.dumps`` cannot produce.
RAW = {
    "\x01deep10000": b"[" * 10_000 + b"]" * 10_000,
    "\x01deep150": b"[" * 150 + b"]" * 150,
    "\x01digits5000": b"1" * 5000,
}
INTEGERS = [2**63, -(2**63) - 1, 2**63 - 1, -(2**63), 2**64, 2**31, -1, 0, 1, 2, 17, 21, 10**30, 10**4000]
FLOATS = [math.inf, -math.inf, math.nan, 1e308, -1e308, -0.0, 5e-324, 1e-7, 0.5, 1.0000001, 2.5]
STRINGS = ["", "x" * 1_000_000, "\ud800", "\udfff", "\x00", "<|im_end|>", "NaN", "user", "auto", "text"]


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


WRONG_TYPES = [True, False, None, [], {}, [None], {"type": None}, nested(90), *RAW]
EXTREMES: list[Any] = [*INTEGERS, *FLOATS, *STRINGS, *WRONG_TYPES]
#: A value, or the value inside an array or an object (lists of token ids, content blocks).
VALUES = (
    st.sampled_from(EXTREMES)
    | st.sampled_from(EXTREMES).map(lambda v: [v])
    | st.sampled_from(EXTREMES).map(lambda v: {"type": "text", "text": v})
)

Path_ = tuple[str | int, ...]
MESSAGE_FIELDS: list[Path_] = [
    ("messages",),
    ("messages", 0),
    ("messages", 0, "role"),
    ("messages", 0, "content"),
    ("messages", 0, "name"),
    ("messages", 0, "tool_calls"),
    ("messages", 0, "tool_call_id"),
]
SAMPLING: list[Path_] = [("model",), ("temperature",), ("top_p",), ("stream",), ("stop",), ("user",)]
SURFACES: dict[str, tuple[str, dict[str, Any], list[Path_]]] = {
    # name: (path under the rollout, valid body, every field it reads or accepts)
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        [*SAMPLING, *MESSAGE_FIELDS, ("max_tokens",), ("max_completion_tokens",), ("n",), ("seed",),
         ("logprobs",), ("top_logprobs",), ("stream_options",), ("stream_options", "include_usage"),
         ("response_format",), ("response_format", "type"), ("tools",), ("tool_choice",),
         ("parallel_tool_calls",), ("presence_penalty",), ("frequency_penalty",), ("logit_bias",),
         ("functions",), ("function_call",), ("metadata",), ("store",), ("reasoning_effort",)],
    ),
    "completions": (
        "/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 2},
        [*SAMPLING, ("prompt",), ("max_tokens",), ("n",), ("seed",), ("logprobs",), ("echo",),
         ("suffix",), ("best_of",), ("presence_penalty",), ("frequency_penalty",), ("logit_bias",),
         ("stream_options",)],
    ),
    "responses": (
        "/v1/responses",
        {"model": "m", "input": [{"type": "message", "role": "user", "content": "hi"}],
         "max_output_tokens": 2},
        [*SAMPLING, ("input",), ("input", 0), ("input", 0, "type"), ("input", 0, "role"),
         ("input", 0, "content"), ("instructions",), ("max_output_tokens",), ("top_logprobs",),
         ("parallel_tool_calls",), ("metadata",), ("text",), ("text", "format"), ("tools",),
         ("tool_choice",), ("truncation",), ("previous_response_id",), ("conversation",),
         ("reasoning",), ("store",), ("include",), ("max_tool_calls",), ("background",)],
    ),
    "messages": (
        "/v1/messages",
        {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        [*SAMPLING, *MESSAGE_FIELDS[:4], ("max_tokens",), ("system",), ("stop_sequences",), ("top_k",),
         ("metadata",), ("tools",), ("tool_choice",), ("thinking",), ("service_tier",)],
    ),
}  # fmt: skip


def put(body: dict[str, Any], path: Path_, value: Any) -> None:
    """Set ``path`` in ``body`` to ``value`` (its parents exist in the valid body, or are set)."""
    target: Any = body
    for key in path[:-1]:
        try:
            target = target[key]
        except (KeyError, IndexError, TypeError):
            return  # an earlier mutation replaced a parent: nothing to set
    with contextlib.suppress(IndexError, TypeError):
        target[path[-1]] = value


def encode(body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    for marker, text in RAW.items():
        raw = raw.replace(json.dumps(marker).encode(), text)
    return raw


def non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list):
        return any(non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(non_finite(v) for v in value.values())
    return False


@st.composite
def extreme_bodies(draw: st.DrawFn, surface: str) -> tuple[bytes, bool, str]:
    """A valid body with 1-3 fields at their extremes; whether a non-finite number went in; and
    a label for the statistics."""
    _, base, fields = SURFACES[surface]
    body = copy.deepcopy(base)
    if draw(st.booleans()):
        body["stream"] = True
    injected: list[Any] = []
    labels: list[str] = []
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        path = draw(st.sampled_from(fields))
        value = copy.deepcopy(draw(VALUES))  # a later mutation may set a field inside it
        put(body, path, value)
        injected.append(value)
        labels.append(".".join(map(str, path)))
    return encode(body), non_finite(injected), "+".join(labels)


# -- checks -----------------------------------------------------------------------------------


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity, as most clients' parsers do."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} in a response")

    return json.loads(text, parse_constant=refuse)


def check(served: Served, response: httpx.Response, before: int, echoed_non_finite: bool) -> None:
    anthropic = response.request.url.path.endswith("/v1/messages")
    status = response.status_code
    if status >= 400:
        payload = response.json()
        if anthropic:
            assert payload["type"] == "error" and isinstance(payload["error"]["message"], str)
            kind = payload["error"]["type"]
            assert status < 500 or (status == 503 and kind == "overloaded_error"), (status, payload)
        else:
            error = payload["error"]
            assert isinstance(error["message"], str) and isinstance(error["type"], str)
            retryable = status == 503 and error["code"] == "engine_unavailable"
            assert status < 500 or retryable, (status, payload)
        if status != 503:
            assert served.recorded_since(before) == [], "a refused call wrote an event"
        return
    assert status == 200, (status, response.text[:300])
    text = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]" and not echoed_non_finite:
                strict_json(line[6:])
        if "engine_unavailable" not in text and "overloaded_error" not in text:
            assert "server_error" not in text and "api_error" not in text, text[-300:]
        assert "internal error" not in text
    elif not echoed_non_finite:
        strict_json(text)


def held(served: Served, client: httpx.Client) -> tuple[int, int]:
    """The gate's generations in flight and the admission's calls held, once they settle."""
    headers = {"Authorization": f"Bearer {served.app.admin_token}"}
    deadline = time.monotonic() + 10
    while True:
        status = client.get("/admin/status", headers=headers).json()
        counts = status["inflight"], status["calls_held"]
        if counts == (0, 0) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)  # a stream's handler leaves a moment after its last byte


def still_serves(client: httpx.Client, rollout: ActiveRollout) -> None:
    _, base, _ = SURFACES["chat"]
    response = client.post(
        f"/rollouts/{rollout.rollout}/v1/chat/completions",
        json=base,
        headers={"Authorization": f"Bearer {rollout.token}"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


# -- the properties ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "examples",
    [pytest.param(EXAMPLES, id="default"), pytest.param(SLOW_EXAMPLES, id="slow", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_every_field_at_its_extremes(
    surface: str, examples: int, served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    path = f"/rollouts/{rollout.rollout}{SURFACES[surface][0]}"
    headers = {"Authorization": f"Bearer {rollout.token}", "Content-Type": "application/json"}

    @budget(examples)
    @given(case=extreme_bodies(surface))
    def fuzz(case: tuple[bytes, bool, str]) -> None:
        body, echoed_non_finite, label = case
        before = served.app.store.last_position
        response = client.post(path, content=body, headers=headers)
        event(f"HTTP {response.status_code}")  # pytest --hypothesis-show-statistics
        event(label)
        check(served, response, before, echoed_non_finite)

    fuzz()
    still_serves(client, rollout)
    assert held(served, client) == (0, 0)


# -- what the fuzzer found, pinned ------------------------------------------------------------

SEED_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi"}),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("surface", sorted(SEED_BODIES))
@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63, 2**64])
def test_a_seed_beyond_64_bits_is_a_400_and_nothing_hangs(
    surface: str, seed: int, stream: bool, served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    """The bug report: ``"seed": -9223372036854775809`` left the call without an answer for ever
    (torch's generator refused it inside the engine's step loop), and the next switch waited."""
    path, body = SEED_BODIES[surface]
    before = served.app.store.last_position
    response = client.post(
        f"/rollouts/{rollout.rollout}{path}",
        json={**body, "seed": seed, "stream": stream},
        headers={"Authorization": f"Bearer {rollout.token}"},
        timeout=20,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "seed"
    assert served.recorded_since(before) == []
    # The edges of the range are fine.
    for edge in (-(2**63), 2**63 - 1):
        ok = client.post(
            f"/rollouts/{rollout.rollout}{path}",
            json={**body, "seed": edge},
            headers={"Authorization": f"Bearer {rollout.token}"},
            timeout=20,
        )
        assert ok.status_code == 200, ok.text
    assert held(served, client) == (0, 0)


BAD_NUMBERS: list[tuple[str, str, Any]] = [
    # (surface, field, value): each a 400 naming the field, before the engine.
    ("chat", "temperature", math.nan),
    ("chat", "temperature", math.inf),
    ("chat", "temperature", 1e308),
    ("chat", "temperature", 1e-7),
    ("chat", "top_p", -1e-9),
    ("chat", "n", 1.5),
    ("chat", "top_logprobs", 6.5),
    ("completions", "max_tokens", -1),
    ("completions", "max_tokens", 2.0**53 + 2),
    ("chat", "top_p", math.nan),
    ("chat", "top_logprobs", 21),
    ("chat", "n", 2**63),
    ("chat", "max_tokens", 0),
    ("chat", "max_tokens", math.inf),
    ("chat", "max_completion_tokens", -(2**63) - 1),
    ("chat", "presence_penalty", math.nan),
    ("chat", "frequency_penalty", 3),
    ("chat", "seed", True),
    ("completions", "logprobs", 6),
    ("completions", "best_of", 2**63),
    ("completions", "best_of", -1),
    ("completions", "temperature", -math.inf),
    ("completions", "seed", 1.5),
    ("responses", "top_logprobs", -1),
    ("responses", "max_output_tokens", 1e308),
    ("responses", "temperature", math.nan),
    ("messages", "top_k", 2**63),
    ("messages", "top_k", -1),
    ("messages", "temperature", 1.5),
    ("messages", "max_tokens", True),
]


@pytest.mark.parametrize(("surface", "field", "value"), BAD_NUMBERS)
def test_numbers_out_of_range_are_400s_naming_the_field(
    surface: str, field: str, value: Any, served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    path, base, _ = SURFACES[surface]
    before = served.app.store.last_position
    response = client.post(
        f"/rollouts/{rollout.rollout}{path}",
        content=json.dumps({**base, field: value}).encode(),
        headers={"Authorization": f"Bearer {rollout.token}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    payload = response.json()
    if surface == "messages":
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert field in payload["error"]["message"]
    else:
        assert payload["error"]["param"] == field
    assert served.recorded_since(before) == []


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b'{"model": "m", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "deeper than"),
        (b'{"model": "m", "seed": ' + b"1" * 5000 + b"}", "number"),
        (b'{"model": "m", "metadata": ' + b"[" * 150 + b"]" * 150 + b"}", "deeper than"),
    ],
    ids=["nested-10000", "digits-5000", "nested-150"],
)
@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_bodies_python_cannot_walk_are_400s(
    surface: str, raw: bytes, why: str, served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    """Found by the fuzzer: nesting past the recursion limit, and integers of more than 4300
    digits, made ``json.loads`` raise what the body reader did not catch (a 500)."""
    response = client.post(
        f"/rollouts/{rollout.rollout}{SURFACES[surface][0]}",
        content=raw,
        headers={"Authorization": f"Bearer {rollout.token}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert why in response.text


def test_after_the_fuzzing_nothing_is_held_and_a_training_step_completes(
    served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    """The switch waits for every call in flight: had a fuzzed call been lost inside the engine,
    the step would never start."""
    still_serves(client, rollout)
    assert held(served, client) == (0, 0)
    assert served.run(served.app.run(), timeout_s=300) == "reached step 1"
    assert served.app.engine.policy_version == 1
