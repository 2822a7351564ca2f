"""Every body and every streamed event of every surface, validated strictly against the SDKs' own
typed models.

The openai and anthropic SDKs describe each response, stream event and error with pydantic
models; a client (or a harness that type-checks what it gets) relies on them. Each test here
sends raw HTTP (so what is checked is the exact bytes the proxy wrote, not what an SDK made of
them), validates every JSON document with ``strict=True`` against the model the SDK would parse
it as, and then walks the result for keys the model does not declare: the SDK models allow extra
fields, so an undeclared key (a typo, a field from another API) would otherwise pass unseen.

Each surface is covered whole and streamed, with every optional request field its spec allows
set at least once; the fields the proxy refuses on purpose are asserted as clean 400s whose error
bodies validate too. Tool calls, thinking blocks, cut-off answers and errors in the middle of a
stream come from a scripted engine (``Script``): the tiny random model seldom writes them itself.

Where the proxy's output does not validate, the test is an expected failure that names the
mismatch: ``Checker.assert_clean(known=...)`` raises ``KnownMismatch`` only when the mismatches
are exactly the named ones, so any other mismatch (or a fixed one) still fails the test.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import aiohttp
import anthropic.types as anthropic_types
import pydantic
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.shared import ErrorObject

from appliance.app import Appliance
from appliance.chat.formats import QWEN3
from appliance.chat.tokenizer import Tokenizer
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.rollouts.registry import ActiveRollout
from contracts.errors import EngineUnavailable
from tests.support import make_config, register_rollout

Json = dict[str, Any]
USER = [{"role": "user", "content": "What is 3 + 4?"}]
LOGPROB = -0.25
ADD_PARAMETERS: Json = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
#: A hermes tool call after some text: what the proxy parses into a tool call on every surface.
TOOL_TEXT = (
    "Let me add.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>'
)
JSON_SCHEMA: Json = {
    "name": "sum",
    "description": "The sum.",
    "schema": {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]},
    "strict": True,
}


# --- the checks ------------------------------------------------------------------------------


class OpenAIErrorBody(pydantic.BaseModel):
    """``{"error": {...}}``, as the openai SDK reads an error response (its ``ErrorObject``)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    error: ErrorObject


class OpenAIModelList(pydantic.BaseModel):
    """``GET /v1/models`` as the openai SDK's page reads it."""

    model_config = pydantic.ConfigDict(extra="forbid")
    object: Literal["list"]
    data: list[Model]


class AnthropicModelList(pydantic.BaseModel):
    """``GET /v1/models`` as the anthropic SDK's page reads it."""

    model_config = pydantic.ConfigDict(extra="forbid")
    data: list[anthropic_types.ModelInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None


class Ping(pydantic.BaseModel):
    """Anthropic's keep-alive event (the SDK skips it; it has no model of its own)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    type: Literal["ping"]


@cache
def adapter(kind: Any) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(kind)


def undeclared(value: object) -> Iterator[str]:
    """``Model.key`` for every key, at any depth, that the validated models do not declare."""
    if isinstance(value, pydantic.BaseModel):
        for key in value.model_extra or {}:
            yield f"{type(value).__name__}.{key}"
        for name in type(value).model_fields:
            yield from undeclared(getattr(value, name))
    elif isinstance(value, list | tuple):
        for item in value:
            yield from undeclared(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from undeclared(item)


class KnownMismatch(AssertionError):
    """The documents fail to validate in exactly the ways a test names (an ``xfail`` of it
    expects this exception only, so any other mismatch still fails the test)."""


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return "an object with " + ", ".join(sorted(map(str, value)))
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Checker:
    """Validates documents and collects every distinct mismatch, so one failure lists them all.

    A mismatch reads ``<where> as <Model>: <field path>: <what pydantic says> (sent <value>)`` or
    ``undeclared key <Model>.<key>`` (the innermost model that lacks the key); list positions are
    left out so the same mismatch in every chunk of a stream is listed once."""

    problems: list[str] = field(default_factory=list)

    def note(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)

    def check(self, kind: Any, raw: str | bytes, where: str) -> Any:
        """``raw`` validated strictly as ``kind``; None (and the mismatches noted) if it fails."""
        name = getattr(kind, "__name__", "event")
        try:
            value = adapter(kind).validate_json(raw, strict=True)
        except pydantic.ValidationError as exc:
            for error in exc.errors(include_url=False):
                at = ".".join("*" if isinstance(part, int) else str(part) for part in error["loc"])
                self.note(f"{where} as {name}: {at}: {error['msg']} (sent {_shown(error['input'])})")
            return None
        for key in undeclared(value):
            self.note(f"undeclared key {key}")
        return value

    def expect(self, condition: bool, what: str) -> None:
        if not condition:
            self.note(what)

    def assert_clean(self, known: tuple[str, ...] = ()) -> None:
        """No mismatch; or, when ``known`` names some, exactly those (raised as ``KnownMismatch``)."""
        if known and sorted(self.problems) == sorted(known):
            raise KnownMismatch("\n".join(self.problems))
        assert self.problems == [], "\n".join(self.problems)


@dataclass
class Event:
    name: str | None
    data: str


def sse_events(raw: bytes) -> list[Event]:
    """The events of a whole text/event-stream body."""
    events: list[Event] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        events.append(Event(name, "\n".join(data)))
    return events


# --- the appliance, the requests and the scripted engine ---------------------------------------


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


@pytest.fixture
def active(app: Appliance) -> ActiveRollout:
    return register_rollout(app)


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@dataclass
class Reply:
    status: int
    content_type: str
    raw: bytes

    def json(self) -> Json:
        body: Json = json.loads(self.raw)
        return body


async def send(
    app: Appliance,
    active: ActiveRollout,
    path: str,
    body: Json | None = None,
    *,
    anthropic: bool = False,
) -> Reply:
    """POST ``body`` (GET without one) to the rollout's ``/v1`` + ``path``, as an OpenAI client
    (bearer token) or an Anthropic one (``x-api-key`` and ``anthropic-version``)."""
    headers = (
        {"x-api-key": active.token, "anthropic-version": "2023-06-01"}
        if anthropic
        else {"Authorization": f"Bearer {active.token}"}
    )
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1{path}"
    async with aiohttp.ClientSession() as http:
        method = (
            http.get(url, headers=headers) if body is None else http.post(url, json=body, headers=headers)
        )
        async with method as response:
            return Reply(response.status, response.content_type, await response.read())


class Script:
    """Answers the next calls with fixed texts, token by token as an engine streams them, then
    hands calls to the real engine. ``fail`` makes each scripted call fail after its tokens."""

    def __init__(self, app: Appliance, tokenizer: Tokenizer, *texts: str, fail: bool = False) -> None:
        self.real = app.engine.generate
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.fail = fail

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not self.texts:
            return await self.real(request)
        ids = [*self.tokenizer.encode(self.texts.pop(0)), self.tokenizer.im_end_id]
        cut = ids[: request.params.max_tokens]
        for token in cut:
            if request.on_token is not None:
                request.on_token(token, LOGPROB)
            await asyncio.sleep(0)
        if self.fail:
            raise EngineUnavailable("the engine failed (scripted)")
        k = request.params.top_logprobs
        tops = tuple(tuple((t, LOGPROB - j) for j in range(k)) for t in cut) if k else ()
        return GenerateResult(
            token_ids=tuple(cut),
            logprobs=(LOGPROB,) * len(cut),
            finish_reason="stop" if cut == ids else "length",
            policy_version=0,
            top_logprobs=tops,
        )


def script(
    app: Appliance, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, *texts: str, fail: bool = False
) -> None:
    monkeypatch.setattr(app.engine, "generate", Script(app, tokenizer, *texts, fail=fail).generate)


async def refused(
    checker: Checker,
    app: Appliance,
    active: ActiveRollout,
    path: str,
    body: Json,
    param: str | None,
    *,
    anthropic: bool = False,
) -> None:
    """``body`` is answered with a clean 400 whose error body validates (naming ``param``)."""
    reply = await send(app, active, path, body, anthropic=anthropic)
    where = f"{path} {sorted(set(body) - {'model', 'messages', 'prompt', 'input', 'max_tokens'})}"
    checker.expect(reply.status == 400, f"{where}: status {reply.status}, not 400: {reply.raw!r}")
    checker.expect(reply.content_type == "application/json", f"{where}: content type {reply.content_type}")
    if anthropic:
        error = checker.check(anthropic_types.ErrorResponse, reply.raw, where)
        if error is not None:
            checker.expect(error.error.type == "invalid_request_error", f"{where}: {error.error.type}")
    else:
        error = checker.check(OpenAIErrorBody, reply.raw, where)
        if error is not None:
            checker.expect(error.error.type == "invalid_request_error", f"{where}: {error.error.type}")
            checker.expect(error.error.param == param, f"{where}: param {error.error.param!r}, not {param!r}")


# --- OpenAI Chat Completions -------------------------------------------------------------------


async def openai_whole(checker: Checker, reply: Reply, kind: Any, where: str) -> Json:
    """A 200 JSON body, validated as ``kind``; returned as JSON."""
    assert reply.status == 200, reply.raw
    checker.expect(reply.content_type == "application/json", f"{where}: content type {reply.content_type}")
    checker.check(kind, reply.raw, where)
    return reply.json()


def openai_stream(checker: Checker, reply: Reply, kind: Any, where: str) -> list[Json]:
    """An OpenAI-style stream: unnamed events, each ``kind`` (or an error), then ``[DONE]``.
    Returns the events' JSON, errors included."""
    assert reply.status == 200, reply.raw
    assert reply.content_type == "text/event-stream"
    events = sse_events(reply.raw)
    assert events and events[-1].data == "[DONE]", events[-1:]
    out: list[Json] = []
    for event in events[:-1]:
        checker.expect(event.name is None, f"{where}: an event name {event.name!r}")
        data: Json = json.loads(event.data)
        checker.check(OpenAIErrorBody if "error" in data else kind, event.data, where)
        out.append(data)
    return out


async def chat_whole(checker: Checker, app: Appliance, active: ActiveRollout, body: Json) -> Json:
    reply = await send(app, active, "/chat/completions", {"model": app.model_name, "messages": USER, **body})
    return await openai_whole(checker, reply, ChatCompletion, "chat.completion")


async def chat_stream(checker: Checker, app: Appliance, active: ActiveRollout, body: Json) -> list[Json]:
    full = {"model": app.model_name, "messages": USER, **body, "stream": True}
    reply = await send(app, active, "/chat/completions", full)
    return openai_stream(checker, reply, ChatCompletionChunk, "chat.completion.chunk")


async def test_chat_plain_whole_and_streamed(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    completion = await chat_whole(checker, app, active, {})
    assert completion["choices"][0]["message"]["role"] == "assistant"
    chunks = await chat_stream(checker, app, active, {})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    checker.assert_clean()


async def test_chat_every_sampling_field(app: Appliance, active: ActiveRollout) -> None:
    """n > 1, logprobs with top_logprobs, stop, seed, both token limits, temperature/top_p, all
    three response formats, the zero penalties and empty bias, and the harmless user, metadata,
    store and service_tier."""
    checker = Checker()
    many = await chat_whole(
        checker,
        app,
        active,
        {
            "n": 3,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": ["\n\n", "."],
            "seed": 7,
            "max_completion_tokens": 5,
            "temperature": 0.7,
            "top_p": 0.9,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "user": "u-1",
            "metadata": {"k": "v"},
            "store": False,
            "service_tier": "auto",
        },
    )
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    for choice in many["choices"]:
        assert choice["logprobs"]["content"]
        assert all(len(t["top_logprobs"]) == 3 for t in choice["logprobs"]["content"])
    assert many["usage"]["completion_tokens"] <= 15
    # Under a response format fewer than top_logprobs tokens may be allowed at a position.
    constrained = await chat_whole(
        checker,
        app,
        active,
        {"response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 2, "max_tokens": 5},
    )
    for token in constrained["choices"][0]["logprobs"]["content"]:
        assert 1 <= len(token["top_logprobs"]) <= 2
    await chat_whole(
        checker,
        app,
        active,
        {
            "max_tokens": 4,
            "temperature": 0,
            "top_p": 0,
            "stop": "\n",
            "logprobs": False,
            "response_format": {"type": "json_schema", "json_schema": JSON_SCHEMA},
        },
    )
    await chat_whole(checker, app, active, {"max_tokens": 3, "response_format": {"type": "text"}})
    checker.assert_clean()


async def test_chat_stream_with_usage_and_options(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    chunks = await chat_stream(
        checker,
        app,
        active,
        {
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 5,
            "seed": 3,
            "stop": ["."],
            "temperature": 0.5,
            "top_p": 0.5,
            "response_format": {"type": "json_object"},
            "user": "u",
            "metadata": {"k": "v"},
            "store": False,
        },
    )
    # Every chunk carries the usage key (null), the last one the counts and no choices.
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    checker.assert_clean()


CHAT_TOOLS: list[Json] = [
    {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": ADD_PARAMETERS}},
    {"type": "function", "function": {"name": "noop", "strict": False}},
]


@pytest.mark.parametrize(
    "tool_choice",
    ["auto", "required", {"type": "function", "function": {"name": "add"}}, None],
    ids=["auto", "required", "named", "unset"],
)
async def test_chat_tool_calls(
    app: Appliance,
    active: ActiveRollout,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    tool_choice: object,
) -> None:
    """Two parallel calls after some text: ``ChatCompletionMessageToolCall`` whole, tool-call
    deltas streamed."""
    script(app, tokenizer, monkeypatch, TOOL_TEXT, TOOL_TEXT)
    body: Json = {"tools": CHAT_TOOLS, "parallel_tool_calls": True, "max_tokens": 100}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    checker = Checker()
    completion = await chat_whole(checker, app, active, {**body, "logprobs": True, "top_logprobs": 1})
    (choice,) = completion["choices"]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [("function", "add")] * 2
    chunks = await chat_stream(checker, app, active, {**body, "parallel_tool_calls": False})
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "add"), (1, "add")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    checker.assert_clean()


async def test_chat_tool_choice_none_and_deprecated_functions(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(app, tokenizer, monkeypatch, TOOL_TEXT, TOOL_TEXT, TOOL_TEXT, TOOL_TEXT)
    tool = CHAT_TOOLS[0]
    checker = Checker()
    hide: Json = {"tools": [tool], "tool_choice": "none", "max_tokens": 100}
    hidden = await chat_whole(checker, app, active, hide)
    assert hidden["choices"][0]["message"].get("tool_calls") is None  # no tools shown, none parsed
    await chat_stream(checker, app, active, hide)
    old: Json = {"functions": [tool["function"]], "function_call": {"name": "add"}, "max_tokens": 100}
    called = await chat_whole(checker, app, active, old)
    assert called["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    await chat_whole(checker, app, active, {**old, "function_call": "auto"})
    checker.assert_clean()


CHAT_REFUSED: list[tuple[Json, str]] = [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"n": 17}, "n"),
    ({"n": 2, "stream": True}, "n"),
    ({"temperature": 1e-7}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"seed": 1.5}, "seed"),
]


async def test_chat_refusals_are_clean_400s(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    for extra, param in CHAT_REFUSED:
        body = {"model": app.model_name, "messages": USER, **extra}
        await refused(checker, app, active, "/chat/completions", body, param)
    checker.assert_clean()


async def test_chat_engine_failure_whole_and_in_the_stream(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the headers went out arrives as an error event, then [DONE]; before them,
    as a 503 error body."""
    script(app, tokenizer, monkeypatch, "Hello there", "Hello there", fail=True)
    checker = Checker()
    chunks = await chat_stream(checker, app, active, {"max_tokens": 20})
    assert [c["error"]["code"] for c in chunks if "error" in c] == ["engine_unavailable"]
    reply = await send(app, active, "/chat/completions", {"model": app.model_name, "messages": USER})
    assert reply.status == 503
    checker.check(OpenAIErrorBody, reply.raw, "503 body")
    checker.assert_clean()


# --- OpenAI Completions ------------------------------------------------------------------------

#: The SDK types a choice's ``finish_reason`` as never null, also in the ``Completion`` it parses
#: each streamed chunk as; OpenAI's own stream (and the proxy's) sends null until the last chunk.
NULL_FINISH = (
    "text_completion chunk as Completion: choices.*.finish_reason: Input should be 'stop', 'length' "
    "or 'content_filter' (sent None)"
)


async def completion_whole(checker: Checker, app: Appliance, active: ActiveRollout, body: Json) -> Json:
    reply = await send(app, active, "/completions", {"model": app.model_name, "prompt": "1 + 2 =", **body})
    return await openai_whole(checker, reply, Completion, "text_completion")


async def completion_stream(
    checker: Checker, app: Appliance, active: ActiveRollout, body: Json
) -> list[Json]:
    full = {"model": app.model_name, "prompt": "1 + 2 =", **body, "stream": True}
    reply = await send(app, active, "/completions", full)
    return openai_stream(checker, reply, Completion, "text_completion chunk")


async def test_completions_whole_with_every_field(app: Appliance, active: ActiveRollout) -> None:
    """n with an equal best_of, logprobs, stop, seed, temperature/top_p, an empty suffix, the zero
    penalties, user; batches of text and token-id prompts; max_tokens 0."""
    checker = Checker()
    many = await completion_whole(
        checker,
        app,
        active,
        {
            "n": 2,
            "best_of": 2,
            "logprobs": 3,
            "stop": ["\n\n"],
            "seed": 11,
            "max_tokens": 5,
            "temperature": 0.8,
            "top_p": 0.95,
            "suffix": "",
            "presence_penalty": 0,
            "frequency_penalty": 0,
            "logit_bias": {},
            "user": "u",
        },
    )
    assert [c["index"] for c in many["choices"]] == [0, 1]
    for choice in many["choices"]:
        assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["top_logprobs"]) > 0
    batch = await completion_whole(
        checker, app, active, {"prompt": ["a", [1, 2, 3]], "logprobs": 0, "stop": ".", "max_tokens": 3}
    )
    assert len(batch["choices"]) == 2
    nothing = await completion_whole(checker, app, active, {"max_tokens": 0, "echo": True})
    assert (nothing["choices"][0]["text"], nothing["choices"][0]["finish_reason"]) == ("1 + 2 =", "length")
    checker.assert_clean()


#: With ``echo`` and ``logprobs`` the first prompt token has no log-prob and no alternatives:
#: OpenAI sends null for both (as the proxy does); the SDK types the list items as never null.
NULL_FIRST_TOKEN = (
    "text_completion as Completion: choices.*.logprobs.token_logprobs.*: Input should be a valid "
    "number (sent None)",
    "text_completion as Completion: choices.*.logprobs.top_logprobs.*: Input should be an object (sent None)",
)


@pytest.mark.xfail(strict=True, raises=KnownMismatch, reason="; ".join(NULL_FIRST_TOKEN))
async def test_completions_echo_with_logprobs(app: Appliance, active: ActiveRollout) -> None:
    """``echo`` with ``logprobs``, sampling and with ``max_tokens: 0``."""
    checker = Checker()
    echoed = await completion_whole(
        checker, app, active, {"echo": True, "logprobs": 2, "max_tokens": 4, "n": 2}
    )
    for choice in echoed["choices"]:
        assert choice["text"].startswith("1 + 2 =")
        assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["text_offset"]) > 0
    await completion_whole(checker, app, active, {"max_tokens": 0, "echo": True, "logprobs": 1})
    checker.assert_clean(known=NULL_FIRST_TOKEN)


@pytest.mark.xfail(strict=True, raises=KnownMismatch, reason=NULL_FINISH)
async def test_completions_streamed(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    chunks = await completion_stream(checker, app, active, {"max_tokens": 5})
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    checker.assert_clean(known=(NULL_FINISH,))


@pytest.mark.xfail(strict=True, raises=KnownMismatch, reason=NULL_FINISH)
async def test_completions_streamed_with_echo_usage_and_options(
    app: Appliance, active: ActiveRollout
) -> None:
    checker = Checker()
    chunks = await completion_stream(
        checker,
        app,
        active,
        {
            "echo": True,
            "stream_options": {"include_usage": True},
            "logprobs": 2,
            "max_tokens": 5,
            "seed": 1,
            "stop": ["\n"],
            "temperature": 0.5,
            "top_p": 0.5,
            "user": "u",
        },
    )
    assert chunks[0]["choices"][0]["text"] == "1 + 2 ="
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    nothing = await completion_stream(checker, app, active, {"max_tokens": 0, "echo": True})
    assert [c["choices"][0]["text"] for c in nothing] == ["1 + 2 =", ""]
    checker.assert_clean(known=(NULL_FINISH,))


COMPLETIONS_REFUSED: list[tuple[Json, str]] = [
    ({"best_of": 3}, "best_of"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"suffix": "after"}, "suffix"),
    ({"presence_penalty": 1}, "presence_penalty"),
    ({"frequency_penalty": 2}, "frequency_penalty"),
    ({"logit_bias": {"7": -100}}, "logit_bias"),
    ({"logprobs": 6}, "logprobs"),
    ({"n": 2, "stream": True}, "n"),
    ({"prompt": [[]]}, "prompt"),
    ({"echo": "yes"}, "echo"),
]


async def test_completions_refusals_are_clean_400s(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    for extra, param in COMPLETIONS_REFUSED:
        body = {"model": app.model_name, "prompt": "x", **extra}
        await refused(checker, app, active, "/completions", body, param)
    checker.assert_clean()


@pytest.mark.xfail(strict=True, raises=KnownMismatch, reason=NULL_FINISH)
async def test_completions_engine_failure_whole_and_in_the_stream(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(app, tokenizer, monkeypatch, "Hello there", "Hello there", fail=True)
    checker = Checker()
    chunks = await completion_stream(checker, app, active, {"max_tokens": 20})
    assert [c["error"]["code"] for c in chunks if "error" in c] == ["engine_unavailable"]
    reply = await send(app, active, "/completions", {"model": app.model_name, "prompt": "x"})
    assert reply.status == 503
    checker.check(OpenAIErrorBody, reply.raw, "503 body")
    checker.assert_clean(known=(NULL_FINISH,))


# --- OpenAI Responses --------------------------------------------------------------------------

ADD_FUNCTION: Json = {"type": "function", "name": "add", "description": "Add.", "parameters": ADD_PARAMETERS}


async def responses_whole(checker: Checker, app: Appliance, active: ActiveRollout, body: Json) -> Json:
    reply = await send(
        app, active, "/responses", {"model": app.model_name, "input": "What is 3 + 4?", **body}
    )
    return await openai_whole(checker, reply, Response, "response")


async def responses_stream(checker: Checker, app: Appliance, active: ActiveRollout, body: Json) -> list[Json]:
    """The events, each validated as the ``ResponseStreamEvent`` union (the SDK's discriminated
    union, through a ``TypeAdapter``), named by its type and numbered from 0."""
    full = {"model": app.model_name, "input": "What is 3 + 4?", **body, "stream": True}
    reply = await send(app, active, "/responses", full)
    assert reply.status == 200, reply.raw
    assert reply.content_type == "text/event-stream"
    out: list[Json] = []
    for i, event in enumerate(sse_events(reply.raw)):
        data: Json = json.loads(event.data)
        where = f"response event {data.get('type')!r}"
        value = checker.check(ResponseStreamEvent, event.data, where)
        checker.expect(value is None or value.type == data.get("type"), f"{where}: read as {value!r}")
        checker.expect(event.name == data.get("type"), f"{where}: sent as event {event.name!r}")
        checker.expect(
            data.get("sequence_number") == i, f"{where}: sequence_number {data.get('sequence_number')}"
        )
        out.append(data)
    return out


def kinds(events: list[Json]) -> list[str]:
    return [str(e["type"]) for e in events]


async def test_responses_plain_whole_and_streamed(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    response = await responses_whole(checker, app, active, {})
    assert response["output"][0]["type"] == "message"
    events = await responses_stream(checker, app, active, {})
    assert kinds(events)[:2] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    checker.assert_clean()


#: Every optional field the proxy serves (``previous_response_id`` needs a stored response;
#: ``conversation`` is refused: the proxy keeps no conversations).
RESPONSES_OPTIONS: Json = {
    "instructions": "Answer briefly.",
    "max_output_tokens": 6,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_logprobs": 2,
    "metadata": {"k": "v"},
    "user": "u",
    "store": False,
    "truncation": "auto",
    "text": {"format": {"type": "json_object"}},
    "reasoning": {"effort": "low"},
    "include": ["message.output_text.logprobs"],
    "parallel_tool_calls": False,
    "service_tier": "auto",
}


async def test_responses_every_field_whole_and_streamed(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    response = await responses_whole(checker, app, active, RESPONSES_OPTIONS)
    assert (response["instructions"], response["metadata"]) == ("Answer briefly.", {"k": "v"})
    assert response["max_output_tokens"] == 6 and response["truncation"] == "auto"
    await responses_stream(checker, app, active, RESPONSES_OPTIONS)
    schema: Json = {"format": {"type": "json_schema", **JSON_SCHEMA}, "verbosity": "low"}
    await responses_whole(checker, app, active, {"text": schema, "max_output_tokens": 3})
    await responses_stream(
        checker, app, active, {"text": {"format": {"type": "text"}}, "max_output_tokens": 3}
    )
    checker.assert_clean()


async def test_responses_incomplete_whole_and_streamed(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(app, tokenizer, monkeypatch, "one two three four five six", "one two three four five six")
    checker = Checker()
    response = await responses_whole(checker, app, active, {"max_output_tokens": 3})
    assert (response["status"], response["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    events = await responses_stream(checker, app, active, {"max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete"
    checker.assert_clean()


@pytest.mark.parametrize(
    "tool_choice",
    ["auto", "required", {"type": "function", "name": "add"}, None],
    ids=["auto", "required", "named", "unset"],
)
async def test_responses_tool_calls(
    app: Appliance,
    active: ActiveRollout,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    tool_choice: object,
) -> None:
    """A message item then two ``function_call`` items, whole and as their event sequence."""
    script(app, tokenizer, monkeypatch, TOOL_TEXT, TOOL_TEXT)
    noop = {"type": "function", "name": "noop", "strict": False, "parameters": {"type": "object"}}
    body: Json = {"tools": [ADD_FUNCTION, noop], "max_output_tokens": 100}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    checker = Checker()
    response = await responses_whole(checker, app, active, body)
    assert [item["type"] for item in response["output"]] == ["message", "function_call", "function_call"]
    events = await responses_stream(checker, app, active, {**body, "parallel_tool_calls": True})
    assert kinds(events).count("response.function_call_arguments.done") == 2
    assert events[-1]["response"]["output"][1]["name"] == "add"
    checker.assert_clean()


async def test_responses_tool_choice_none_and_input_items(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tool_choice none; a history of every input item type the proxy reads."""
    script(app, tokenizer, monkeypatch, TOOL_TEXT, TOOL_TEXT)
    checker = Checker()
    hidden = await responses_whole(checker, app, active, {"tools": [ADD_FUNCTION], "tool_choice": "none"})
    assert [item["type"] for item in hidden["output"]] == ["message"]
    history: list[Json] = [
        {"type": "message", "role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "3 + 4?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 3, "b": 4}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "7"},
    ]
    await responses_whole(
        checker, app, active, {"input": history, "tools": [ADD_FUNCTION], "max_output_tokens": 3}
    )
    await responses_stream(
        checker, app, active, {"input": history, "tools": [ADD_FUNCTION], "max_output_tokens": 3}
    )
    checker.assert_clean()


RESPONSES_REFUSED: list[tuple[Json, str]] = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": "k=v"}, "metadata"),
]


async def test_responses_refusals_are_clean_400s(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    for extra, param in RESPONSES_REFUSED:
        body = {"model": app.model_name, "input": "x", **extra}
        await refused(checker, app, active, "/responses", body, param)
    checker.assert_clean()


async def test_responses_engine_failure_whole_and_in_the_stream(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the headers, a failure is a ``ResponseErrorEvent``; before them, a 503 error body."""
    script(app, tokenizer, monkeypatch, "Hello there", "Hello there", fail=True)
    checker = Checker()
    events = await responses_stream(checker, app, active, {"max_output_tokens": 20})
    assert events[-1]["type"] == "error" and events[-1]["code"] == "engine_unavailable"
    reply = await send(app, active, "/responses", {"model": app.model_name, "input": "x"})
    assert reply.status == 503
    checker.check(OpenAIErrorBody, reply.raw, "503 body")
    checker.assert_clean()


# --- Anthropic Messages ------------------------------------------------------------------------

WEATHER: Json = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ADD_TOOL: Json = {"name": "add", "input_schema": ADD_PARAMETERS}


async def message_whole(checker: Checker, app: Appliance, active: ActiveRollout, body: Json) -> Json:
    full = {"model": app.model_name, "max_tokens": 8, "messages": USER, **body}
    reply = await send(app, active, "/messages", full, anthropic=True)
    assert reply.status == 200, reply.raw
    checker.expect(reply.content_type == "application/json", f"message: content type {reply.content_type}")
    checker.check(anthropic_types.Message, reply.raw, "message")
    return reply.json()


async def message_stream(checker: Checker, app: Appliance, active: ActiveRollout, body: Json) -> list[Json]:
    """The events: each a ``RawMessageStreamEvent`` (the SDK's union, through a ``TypeAdapter``),
    a ``ping`` or an ``ErrorResponse``, sent under its own type as the event name."""
    full = {"model": app.model_name, "max_tokens": 8, "messages": USER, **body, "stream": True}
    reply = await send(app, active, "/messages", full, anthropic=True)
    assert reply.status == 200, reply.raw
    assert reply.content_type == "text/event-stream"
    out: list[Json] = []
    for event in sse_events(reply.raw):
        data: Json = json.loads(event.data)
        kind = data.get("type")
        where = f"message event {kind!r}"
        model: Any = {"ping": Ping, "error": anthropic_types.ErrorResponse}.get(
            str(kind), anthropic_types.RawMessageStreamEvent
        )
        value = checker.check(model, event.data, where)
        checker.expect(value is None or value.type == kind, f"{where}: read as {value!r}")
        checker.expect(event.name == kind, f"{where}: sent as event {event.name!r}")
        out.append(data)
    return out


def blocks(events: list[Json]) -> list[str]:
    return [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]


async def test_messages_plain_whole_and_streamed(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    message = await message_whole(checker, app, active, {})
    assert message["stop_reason"] in ("end_turn", "max_tokens")
    events = await message_stream(checker, app, active, {})
    assert [e["type"] for e in events][:2] == ["message_start", "ping"]
    assert events[-1]["type"] == "message_stop"
    checker.assert_clean()


#: Every optional field: system as a string, stop sequences, top_k, temperature/top_p, metadata,
#: thinking (accepted; a reasoning model's thinking blocks are tested below), service_tier.
MESSAGE_OPTIONS: Json = {
    "system": "Be brief.",
    "stop_sequences": ["\n\n", "END"],
    "top_k": 40,
    "temperature": 0.7,
    "top_p": 0.9,
    "metadata": {"user_id": "u-1"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "service_tier": "auto",
}


async def test_messages_every_field_whole_and_streamed(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    await message_whole(checker, app, active, MESSAGE_OPTIONS)
    await message_stream(checker, app, active, MESSAGE_OPTIONS)
    system_blocks: Json = {
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "thinking": {"type": "disabled"},
        "temperature": 0,
    }
    await message_whole(checker, app, active, system_blocks)
    await message_stream(checker, app, active, system_blocks)
    checker.assert_clean()


async def test_messages_stop_sequence_and_max_tokens(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "Seven. END of answer and more words"
    script(app, tokenizer, monkeypatch, text, text, text, text)
    checker = Checker()
    stop: Json = {"stop_sequences": ["END"], "max_tokens": 50}
    stopped = await message_whole(checker, app, active, stop)
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    events = await message_stream(checker, app, active, stop)
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    cut = await message_whole(checker, app, active, {"max_tokens": 2})
    assert cut["stop_reason"] == "max_tokens"
    events = await message_stream(checker, app, active, {"max_tokens": 2})
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    checker.assert_clean()


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "add"}, None],
    ids=["auto", "any", "tool", "unset"],
)
async def test_messages_tool_use(
    app: Appliance,
    active: ActiveRollout,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    tool_choice: Json | None,
) -> None:
    """Text then two ``tool_use`` blocks whole; streamed, each tool_use block's input as one
    ``input_json_delta``."""
    script(app, tokenizer, monkeypatch, TOOL_TEXT, TOOL_TEXT)
    body: Json = {"tools": [ADD_TOOL, WEATHER], "max_tokens": 100}
    if tool_choice is not None:
        body["tool_choice"] = {**tool_choice, "disable_parallel_tool_use": False}
    checker = Checker()
    message = await message_whole(checker, app, active, body)
    assert [b["type"] for b in message["content"]] == ["text", "tool_use", "tool_use"]
    assert message["content"][1]["input"] == {"a": 3, "b": 4} and message["stop_reason"] == "tool_use"
    events = await message_stream(checker, app, active, body)
    assert blocks(events) == ["text", "tool_use", "tool_use"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert [json.loads(d["partial_json"]) for d in deltas if d["type"] == "input_json_delta"] == [
        {"a": 3, "b": 4},
        {"a": 1, "b": 1},
    ]
    checker.assert_clean()


async def test_messages_tool_choice_none_and_tool_results(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(app, tokenizer, monkeypatch, TOOL_TEXT, TOOL_TEXT)
    checker = Checker()
    hidden: Json = {"tools": [ADD_TOOL], "tool_choice": {"type": "none"}, "max_tokens": 100}
    message = await message_whole(checker, app, active, hidden)
    assert [b["type"] for b in message["content"]] == ["text"]
    await message_stream(checker, app, active, hidden)
    history: list[Json] = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me add."},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 3, "b": 4}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "7"}]},
                {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    await message_whole(checker, app, active, {"messages": history, "tools": [ADD_TOOL]})
    checker.assert_clean()


async def test_messages_thinking_blocks(
    app: Appliance, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reasoning model's ``<think>`` text: a ``thinking`` block (with ``thinking_delta``s)."""
    monkeypatch.setattr(app.registry, "fmt", QWEN3)  # rollouts registered from now on
    active = register_rollout(app, "thinker")
    text = "<think>\nThey want a sum.\n</think>\n\nIt is 7."
    script(app, tokenizer, monkeypatch, text, text)
    checker = Checker()
    thinking: Json = {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 100}
    message = await message_whole(checker, app, active, thinking)
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    events = await message_stream(checker, app, active, thinking)
    assert blocks(events) == ["thinking", "text"]
    assert "thinking_delta" in {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
    checker.assert_clean()


MESSAGES_REFUSED: list[Json] = [
    {"max_tokens": None},
    {"max_tokens": 0},
    {"temperature": 1.5},
    {"top_k": -1},
    {"stop_sequences": "END"},
    {"metadata": "u"},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tools": [ADD_TOOL], "tool_choice": {"type": "tool", "name": "missing"}},
    {"messages": [*USER, {"role": "assistant", "content": "The answer is"}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
]


async def test_messages_refusals_are_clean_400s(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    for extra in MESSAGES_REFUSED:
        body = {"model": app.model_name, "max_tokens": 8, "messages": USER, **extra}
        await refused(checker, app, active, "/messages", body, None, anthropic=True)
    checker.assert_clean()


async def test_messages_engine_failure_whole_and_in_the_stream(
    app: Appliance, active: ActiveRollout, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(app, tokenizer, monkeypatch, "Hello there", "Hello there", fail=True)
    checker = Checker()
    events = await message_stream(checker, app, active, {"max_tokens": 20})
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "overloaded_error"
    body = {"model": app.model_name, "max_tokens": 8, "messages": USER}
    reply = await send(app, active, "/messages", body, anthropic=True)
    assert reply.status == 503
    checker.check(anthropic_types.ErrorResponse, reply.raw, "503 body")
    checker.assert_clean()


async def test_count_tokens(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    body = {"model": app.model_name, "system": "Be brief.", "messages": USER, "tools": [WEATHER]}
    reply = await send(app, active, "/messages/count_tokens", body, anthropic=True)
    assert reply.status == 200
    checker.check(anthropic_types.MessageTokensCount, reply.raw, "count_tokens")
    assert reply.json()["input_tokens"] > 0
    checker.assert_clean()


# --- models and errors outside the surfaces ----------------------------------------------------


async def test_openai_models_list_retrieve_and_404(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    listed = await send(app, active, "/models")
    assert listed.status == 200
    checker.check(OpenAIModelList, listed.raw, "models")
    assert [m["id"] for m in listed.json()["data"]] == [app.model_name]
    one = await send(app, active, f"/models/{app.model_name}")
    assert one.status == 200
    checker.check(Model, one.raw, "model")
    missing = await send(app, active, "/models/gpt-4o")
    assert missing.status == 404
    error = checker.check(OpenAIErrorBody, missing.raw, "404 body")
    checker.expect(error is None or error.error.code == "model_not_found", f"404 code: {missing.raw!r}")
    checker.assert_clean()


#: The anthropic SDK's ``ModelInfo`` requires ``lifecycle`` (active, deprecated or retired);
#: the proxy's model object has no such key, listed or retrieved.
SENT_MODEL = "sent an object with created_at, display_name, id, type"


async def test_anthropic_models_list_retrieve_and_404(app: Appliance, active: ActiveRollout) -> None:
    checker = Checker()
    listed = await send(app, active, "/models", anthropic=True)
    assert listed.status == 200
    assert [m["id"] for m in listed.json()["data"]] == [app.model_name]
    checker.check(AnthropicModelList, listed.raw, "models")
    one = await send(app, active, f"/models/{app.model_name}", anthropic=True)
    assert one.status == 200
    checker.check(anthropic_types.ModelInfo, one.raw, "model")
    missing = await send(app, active, "/models/claude-sonnet-4-5", anthropic=True)
    assert missing.status == 404
    error = checker.check(anthropic_types.ErrorResponse, missing.raw, "404 body")
    checker.expect(error is None or error.error.type == "not_found_error", f"404 type: {missing.raw!r}")
    checker.assert_clean()


async def test_auth_and_route_errors_in_each_shape(app: Appliance, active: ActiveRollout) -> None:
    """401 (wrong token), 404 (unknown route) and 400 (bad JSON) bodies, OpenAI's and Anthropic's."""
    checker = Checker()
    url = f"{app.proxy_url}/rollouts/{active.rollout}/v1"
    chat = json.dumps({"model": app.model_name, "messages": USER}).encode()
    message = json.dumps({"model": app.model_name, "max_tokens": 4, "messages": USER}).encode()
    async with aiohttp.ClientSession() as http:
        cases = [
            ("/chat/completions", {"Authorization": "Bearer wrong"}, chat, 401, False),
            ("/messages", {"x-api-key": "wrong", "anthropic-version": "2023-06-01"}, message, 401, True),
            ("/chat/completions", {"Authorization": f"Bearer {active.token}"}, b"{not json", 400, False),
            ("/messages", {"x-api-key": active.token}, b"[1]", 400, True),
            ("/nowhere", {"Authorization": f"Bearer {active.token}"}, b"{}", 404, False),
        ]
        for path, headers, data, status, anthropic in cases:
            async with http.post(url + path, data=data, headers=headers) as response:
                raw = await response.read()
            where = f"{path} {status}"
            checker.expect(response.status == status, f"{where}: status {response.status}")
            checker.check(anthropic_types.ErrorResponse if anthropic else OpenAIErrorBody, raw, where)
    checker.assert_clean()


# --- the checker itself ------------------------------------------------------------------------


def test_the_checker_catches_undeclared_keys_and_loose_types() -> None:
    """What the tests above rely on: an extra key at any depth, a wrong type that lax validation
    would coerce, and a missing field are each reported."""
    good: Json = {
        "id": "m",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi"},
            }
        ],
    }
    checker = Checker()
    checker.check(ChatCompletion, json.dumps(good), "good")
    assert checker.problems == []
    nested = json.loads(json.dumps(good))
    nested["choices"][0]["message"]["extra"] = 1
    checker.check(ChatCompletion, json.dumps(nested), "nested")
    assert checker.problems == ["undeclared key ChatCompletionMessage.extra"]
    loose = {**good, "created": "1"}
    checker = Checker()
    checker.check(ChatCompletion, json.dumps(loose), "loose")
    assert checker.problems == [
        "loose as ChatCompletion: created: Input should be a valid integer (sent '1')"
    ]
    missing = {k: v for k, v in good.items() if k != "model"}
    checker = Checker()
    checker.check(ChatCompletion, json.dumps(missing), "missing")
    assert len(checker.problems) == 1 and "model: Field required" in checker.problems[0]
    with pytest.raises(KnownMismatch):
        checker.assert_clean(known=tuple(checker.problems))
    with pytest.raises(AssertionError):
        checker.assert_clean(known=("something else",))
