"""Property-based fuzzing of every proxy surface and the admin API (hypothesis, fixed budget).

One appliance (tiny model, real torch engine, real store) serves the whole module from a
background thread; hypothesis drives it with a synchronous HTTP client. Bodies are valid
requests with one to three mutations (a field set to arbitrary JSON, a field dropped, the
messages replaced by arbitrary ones, the whole body replaced by arbitrary JSON or bytes), sent
with good or bad credentials. For every example:

* no 5xx, and a stream never carries a server error;
* an error has the surface's shape (OpenAI ``{"error": {...}}``, Anthropic's on ``/messages``);
* a refused call writes no event (the store's last position is unchanged);
* afterwards the appliance still serves a valid call.

The budget is fixed (``derandomize=True``, no example database) so CI runs the same examples
every time.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from appliance.app import Appliance
from appliance.rollouts.registry import ActiveRollout
from store.events import LLMCallRefused
from tests.support import make_config

T = TypeVar("T")
TRACE = Path(os.environ["FUZZ_TRACE"]).open("w") if os.environ.get("FUZZ_TRACE") else None  # noqa: SIM115

#: Examples per surface; the module takes ~30-60 s on a 2-core machine.
EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    # No shrinking: against a live server it can take minutes; the failing example is printed.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Served:
    """An ``Appliance`` running on its own event loop in a background thread."""

    def __init__(self, app: Appliance) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="appliance", daemon=True)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())

    def recorded_since(self, position: int) -> list[str]:
        """The types of the events written after ``position``, refusals (``LLMCallRefused``: a
        rollout's refused calls are counted) left out."""
        stored = self.run(self.app.store.read(position))
        return [item.event.type for item in stored if not isinstance(item.event, LLMCallRefused)]

    def __enter__(self) -> Served:
        self.thread.start()
        self.run(self.app.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.app.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    config = make_config(tmp_path_factory.mktemp("fuzz"), tiny_model_dir, max_tokens=2, max_tokens_cap=3)
    with Served(Appliance(config)) as served:
        yield served


@pytest.fixture(scope="module")
def rollout(served: Served) -> ActiveRollout:
    return served.call(lambda: served.app.registry.register("fuzz", task_id="t", group="g", task={}))


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.app.proxy_url, timeout=20.0) as http:
        yield http


# -- strategies -------------------------------------------------------------------------------

TEXT = st.text(max_size=12) | st.sampled_from(["", "user", "text", "\ud800", "\x00", "<|im_end|>", "é" * 5])
NUMBERS = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 2**64, 10**30, 1e308, -0.0, 0.5])
)
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
ROLES = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "bot", ""]) | JSON
CONTENT = (
    TEXT
    | JSON
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "input_text", "image_url", "tool_use", "tool_result", "x"])},
            optional={"text": TEXT | JSON, "id": TEXT, "name": TEXT, "input": JSON, "content": TEXT | JSON},
        ),
        max_size=3,
    )
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": CONTENT,
        "tool_calls": JSON,
        "tool_call_id": TEXT | JSON,
        "name": TEXT | JSON,
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | JSON,
        "call_id": TEXT,
        "arguments": TEXT | JSON,
        "output": TEXT | JSON,
    },
)
MESSAGES = st.lists(MESSAGE, max_size=4) | JSON

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": "m", "input": "hi", "max_output_tokens": 2}
ANTHROPIC = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

COMMON = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "stop",
    "seed",
    "tools",
    "tool_choice",
    "n",
]
SURFACES: dict[str, tuple[str, dict[str, Any], list[str], str]] = {
    # name: (path under the rollout, valid body, fields to mutate, field holding the conversation)
    "chat": (
        "/v1/chat/completions",
        CHAT,
        [*COMMON, "max_completion_tokens", "stream_options", "logprobs", "top_logprobs", "response_format",
         "parallel_tool_calls", "user", "functions"],
        "messages",
    ),
    "completions": (
        "/v1/completions",
        COMPLETION,
        [*COMMON, "prompt", "logprobs", "echo", "suffix", "best_of", "stream_options"],
        "prompt",
    ),
    "responses": (
        "/v1/responses",
        RESPONSE,
        [*COMMON, "max_output_tokens", "instructions", "previous_response_id", "reasoning", "text", "store"],
        "input",
    ),
    "messages": (
        "/v1/messages",
        ANTHROPIC,
        [*COMMON, "system", "stop_sequences", "top_k", "thinking", "metadata"],
        "messages",
    ),
}  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any], fields: list[str], conversation: str) -> bytes:
    """A valid body with one to three mutations, as the bytes sent."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40) | st.sampled_from([b"", b"{", b"[]", b"null", b'{"a": NaN}']))
    body: Any = dict(base)
    if draw(st.booleans()):
        body["stream"] = True
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 9))
        if not isinstance(body, dict):
            break
        if kind <= 4:  # scalars half the time: plausible values reach the engine more often
            body[draw(st.sampled_from(fields))] = draw(SCALARS | JSON)
        elif kind == 5 and body:
            body.pop(draw(st.sampled_from(sorted(body))), None)
        elif kind <= 7:
            body[conversation] = draw(MESSAGES if conversation != "prompt" else JSON | st.lists(NUMBERS))
        elif kind == 8:
            body[draw(TEXT)] = draw(JSON)
        else:
            body = draw(JSON)
    return json.dumps(body).encode("utf-8", "surrogatepass")


AUTH = st.sampled_from(["bearer", "bearer", "bearer", "bearer", "x-api-key", "none", "wrong", "admin"])


def headers_for(auth: str, rollout: ActiveRollout, admin_token: str) -> dict[str, str]:
    token = {"bearer": rollout.token, "x-api-key": rollout.token, "wrong": "la-wrong", "admin": admin_token}
    if auth == "none":
        return {"Content-Type": "application/json"}
    if auth == "x-api-key":
        return {"x-api-key": token[auth], "anthropic-version": "2023-06-01"}
    return {"Authorization": f"Bearer {token[auth]}", "Content-Type": "application/json"}


# -- checks -----------------------------------------------------------------------------------


def check(served: Served, response: httpx.Response, before: int) -> None:
    """No 5xx; errors in the surface's shape; nothing recorded for a refused call."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        payload = response.json()
        # Anthropic's shape on its route, or for a client that says it speaks Anthropic's API.
        if (
            response.request.url.path.endswith("/v1/messages")
            or "anthropic-version" in response.request.headers
        ):
            assert payload["type"] == "error"
            assert isinstance(payload["error"]["type"], str) and isinstance(payload["error"]["message"], str)
        else:
            assert isinstance(payload["error"]["message"], str) and isinstance(payload["error"]["type"], str)
        assert served.recorded_since(before) == [], "a refused call wrote an event"
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert "server_error" not in response.text and "api_error" not in response.text, response.text[-500:]
        assert "internal error" not in response.text


def still_serves(served: Served, client: httpx.Client, rollout: ActiveRollout) -> None:
    response = client.post(
        f"/rollouts/{rollout.rollout}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {rollout.token}"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


# -- the properties ---------------------------------------------------------------------------


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_surfaces_never_fail_on_bad_input(
    surface: str, served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    path, base, fields, conversation = SURFACES[surface]

    @FUZZ
    @given(body=mutated(base, fields, conversation), auth=AUTH, rollout_less=st.integers(0, 7))
    def fuzz(body: bytes, auth: str, rollout_less: int) -> None:
        prefix = "" if rollout_less == 0 else f"/rollouts/{rollout.rollout}"
        before = served.app.store.last_position
        headers = headers_for(auth, rollout, served.app.admin_token)
        if TRACE is not None:  # FUZZ_TRACE=<file>: each request before it is sent, to replay a hang
            TRACE.write(repr((prefix + path, body, auth)) + "\n")
            TRACE.flush()
        response = client.post(prefix + path, content=body, headers=headers)
        if TRACE is not None:
            TRACE.write(f"# HTTP {response.status_code}\n")
        event(f"HTTP {response.status_code}")  # pytest --hypothesis-show-statistics
        check(served, response, before)

    fuzz()
    still_serves(served, client, rollout)


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    path=st.sampled_from(
        ["/v1/models", "/rollouts/fuzz/v1/models", "/rollouts/fuzz/reward", "/admin/status",
         "/admin/events", "/admin/control", "/healthz", "/rollouts/nobody/reward", "/v1/nothing",
         "/rollouts/fuzz/v1/messages/x"]
    ),
    query=st.dictionaries(st.sampled_from(["after", "limit", "x"]), TEXT | NUMBERS.map(str), max_size=2),
    body=st.fixed_dictionaries({}, optional={"reward": JSON, "action": JSON, "source": JSON}) | JSON,
    auth=AUTH,
)  # fmt: skip
def test_models_reward_and_admin_never_fail_on_bad_input(
    served: Served,
    client: httpx.Client,
    rollout: ActiveRollout,
    method: str,
    path: str,
    query: dict[str, str],
    body: Any,
    auth: str,
) -> None:
    before = served.app.store.last_position
    if path == "/admin/control" and auth in ("admin", "bearer") and method == "POST":
        body = {"action": "resume"} if not isinstance(body, dict) else body  # never stop the appliance
        if body.get("action") == "stop":
            body = {**body, "action": "resume"}
    headers = headers_for(auth, rollout, served.app.admin_token)
    content = json.dumps(body).encode("utf-8", "surrogatepass")
    safe_query = {k: v.encode("utf-8", "replace").decode() for k, v in query.items()}
    response = client.request(method, path, params=safe_query, content=content, headers=headers)
    check(served, response, before)


def test_still_serves_after_fuzzing(served: Served, client: httpx.Client, rollout: ActiveRollout) -> None:
    still_serves(served, client, rollout)
    status = client.get("/admin/status", headers={"Authorization": f"Bearer {served.app.admin_token}"})
    assert status.status_code == 200 and status.json()["calls_held"] == 0


# -- what the fuzzer found, pinned ------------------------------------------------------------


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_an_unpaired_surrogate_is_refused_and_the_store_keeps_writing(
    surface: str, served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    """Found by the fuzzer: ``"\\ud800"`` in any string reached the event log, whose writer could
    not encode it and stopped; every later call then hung."""
    path, base, _, _ = SURFACES[surface]
    before = served.app.store.last_position
    body = json.dumps({**base, "user": "\ud800"}).encode()
    response = client.post(
        f"/rollouts/{rollout.rollout}{path}",
        content=body,
        headers={"Authorization": f"Bearer {rollout.token}"},
    )
    assert response.status_code == 400
    assert "surrogate" in response.text
    assert served.recorded_since(before) == []
    # A surrogate pair is one character, and fine.
    pair = json.dumps({**base, "user": "\U0001f600"}).encode()
    assert b"\\ud83d\\ude00" in pair
    response = client.post(
        f"/rollouts/{rollout.rollout}{path}",
        content=pair,
        headers={"Authorization": f"Bearer {rollout.token}"},
    )
    assert response.status_code == 200, response.text
    still_serves(served, client, rollout)


def test_a_user_agent_that_is_not_utf8_is_recorded_readably(
    served: Served, client: httpx.Client, rollout: ActiveRollout
) -> None:
    response = client.post(
        f"/rollouts/{rollout.rollout}/v1/chat/completions",
        json=CHAT,
        headers=[(b"Authorization", f"Bearer {rollout.token}".encode()), (b"User-Agent", b"agent/\xff\xfe")],
    )
    assert response.status_code == 200, response.text
    (last,) = served.run(served.app.store.read(served.app.store.last_position - 1))
    assert last.event.user_agent == "agent/\ufffd\ufffd"  # type: ignore[attr-defined]
    still_serves(served, client, rollout)
