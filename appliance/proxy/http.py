"""HTTP plumbing shared by every API surface: app state keys, auth, limits, JSON bodies, SSE.

Owns how a request is tied to a rollout (the rollout id in the path, its token as
``Authorization: Bearer`` or ``x-api-key``; the rollout-less ``/v1`` prefix takes the admin
token), the limit on model calls held at once (``Admission``: beyond ``max_queued_calls`` a call
is refused at once with a 429 and ``Retry-After``, before its body is read, so nothing is
recorded for it), how a body is read as JSON, and how JSON answers and server-sent events are
written (a streamed delta's event from a ``JsonSlot``: its JSON written once per stream, only the
delta's text per event; a stream's chunks written straight to its transport from the engine's
callback, ``DirectChunks``). Surfaces import these; nothing here knows any surface's shapes.

How a body is read as JSON is ``appliance.proxy.bodies``'s.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import HttpVersion11, web

from appliance.operations.health import Health
from appliance.proxy.bodies import parse_body
from appliance.proxy.calls import CallService
from appliance.rollouts.registry import DEFAULT_ROLLOUT, ActiveRollout, RolloutRegistry
from contracts.errors import NotFound, Overloaded, Unauthorized

if TYPE_CHECKING:
    from appliance.config import ProxyConfig

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ProxySettings:
    #: The name harnesses are given (the first of ``served_model_names``).
    model_name: str
    #: Completion length of a call that asks for none (None: what the context leaves, capped).
    max_tokens_default: int | None
    max_tokens_cap: int
    #: The temperature used for training samples whatever the client asks (None: the client's).
    temperature_override: float | None
    #: Token for the admin API and the rollout-less ``/v1`` routes.
    admin_token: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    #: Model calls held at once (reading the body, waiting while training, queued in the engine,
    #: generating, streaming); one more is refused with a 429.
    max_queued_calls: int = 4096
    #: Every name the policy answers to on ``/models`` (empty: ``model_name`` alone).
    served_model_names: tuple[str, ...] = ()
    #: ``GET /metrics`` answers loopback clients without the admin token.
    metrics_public: bool = False

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model_name,)

    @classmethod
    def from_config(cls, proxy: ProxyConfig, *, model_name: str, admin_token: str) -> ProxySettings:
        """The settings of a proxy with the ``proxy`` section, serving ``model_name``, whose admin
        token is ``admin_token`` (the section's, or the one generated into the data directory);
        with ``served_model_names`` the policy answers to those names instead, the first given to
        harnesses."""
        return cls(
            model_name=proxy.served_names(model_name)[0],
            served_model_names=proxy.served_model_names,
            max_tokens_default=proxy.max_tokens,
            max_tokens_cap=proxy.max_tokens_cap,
            temperature_override=proxy.temperature,
            admin_token=admin_token,
            max_body_bytes=proxy.max_body_bytes,
            max_queued_calls=proxy.max_queued_calls,
            metrics_public=proxy.metrics_public,
        )


class Admission:
    """Counts the model calls the proxy holds and refuses those beyond ``limit``.

    The count covers a call's whole life in its handler, so it bounds the engine's queue, the
    calls waiting at the serving gate and the open streams together (the backpressure a
    harness sees is a 429 it can retry, never an unbounded queue)."""

    def __init__(self, limit: int, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.held = 0
        #: The most calls held at once so far, and the calls refused.
        self.peak = 0
        self.refused = 0

    def enter(self) -> None:
        if self.held >= self.limit:
            self.refused += 1
            raise Overloaded(
                f"the appliance already holds {self.limit} model calls (max_queued_calls); "
                f"retry in {self.retry_after_s} s",
                code="too_many_queued_calls",
                retry_after_s=self.retry_after_s,
            )
        self.held += 1
        self.peak = max(self.peak, self.held)

    def leave(self) -> None:
        self.held -= 1


CALLS = web.AppKey("calls", CallService)
REGISTRY = web.AppKey("registry", RolloutRegistry)
SETTINGS = web.AppKey("settings", ProxySettings)
ADMISSION = web.AppKey("admission", Admission)
HEALTH = web.AppKey("health", Health)

__all__ = [
    "ADMISSION",
    "CALLS",
    "DEFAULT_ROLLOUT",
    "HEALTH",
    "REGISTRY",
    "SETTINGS",
    "Admission",
    "ProxySettings",
]


def request_token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def anthropic_client(request: web.Request) -> bool:
    """Whether the request comes from an Anthropic client (its SDK sends ``anthropic-version``;
    one that authenticates with ``x-api-key`` and no ``Authorization`` is taken as one too), so a
    route both APIs share (``/v1/models``) answers in Anthropic's shapes."""
    headers = request.headers
    return "anthropic-version" in headers or ("x-api-key" in headers and "Authorization" not in headers)


def check_admin(request: web.Request) -> None:
    expected = request.app[SETTINGS].admin_token
    token = request_token(request)
    if not expected or not token or not hmac.compare_digest(token.encode(), expected.encode()):
        raise Unauthorized("this route needs the admin token (see the data directory's admin_token file)")


#: The rollout a request was authorised for (by ``rollout_of``), kept for the rest of the request.
_ROLLOUT = web.RequestKey("rollout", ActiveRollout)


def wrong_key(rollout: str) -> Unauthorized:
    """The answer to a key that is not ``rollout``'s, and to a rollout that does not exist."""
    return Unauthorized(f"the API key is not valid for rollout {rollout!r}")


def authorize(registry: RolloutRegistry, rollout: str, token: str | None) -> ActiveRollout:
    """``registry.authorize``, except that a rollout never run here is answered as a wrong key
    is (the same 401, the same body): a client cannot probe which rollout ids exist. A rollout
    that ended is still a 409, but only to its own key."""
    try:
        return registry.authorize(rollout, token)
    except (NotFound, Unauthorized):
        raise wrong_key(rollout) from None


def rollout_of(request: web.Request) -> ActiveRollout:
    """The rollout the request is for, authorised by its own token (or the admin token on /v1);
    once authorised, the same rollout for the rest of the request."""
    known: ActiveRollout | None = request.get(_ROLLOUT)
    if known is not None:
        return known
    registry = request.app[REGISTRY]
    rollout = request.match_info.get("rollout")
    if rollout is None:
        check_admin(request)
        active = registry.default()
    else:
        active = authorize(registry, rollout, request_token(request))
    request[_ROLLOUT] = active
    return active


def authorised_rollout(request: web.Request) -> ActiveRollout | None:
    """The rollout ``rollout_of`` authorised for this request; None if it has not (yet)."""
    return request.get(_ROLLOUT)


async def json_body(request: web.Request) -> dict[str, Any]:
    return parse_body(await request.read())


async def sse_start(request: web.Request) -> web.StreamResponse:
    """A server-sent event stream's response, prepared: chunked on HTTP/1.1; on HTTP/1.0, which
    has no chunks, the body ends with the connection, closed after it even where the client
    asked to keep it alive (it could not tell where the stream ends otherwise)."""
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    response = web.StreamResponse(headers=headers)
    if request.version >= HttpVersion11:
        response.headers["Connection"] = "keep-alive"
        response.enable_chunked_encoding()
    else:
        response.force_close()
    await response.prepare(request)
    return response


class DirectChunks:
    """Chunks of a chunked response written straight to its connection's transport, in the
    caller's turn of the event loop (``StreamResponse.write`` is a coroutine: a task must await
    it). For a stream's text written from the engine's callback while the response's task waits.

    Only once the response has sent its headers (a first ``write``); aiohttp writes the
    response's other chunks, the last one included, in the same framing on the same transport,
    so the two only must not interleave (the caller's order is the stream's). ``ready`` is False
    once anything waits in the transport's buffer (the client is behind) or the connection is
    closing: then writes go through the response, which waits for the client to drain.
    """

    __slots__ = ("_transport",)

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    @classmethod
    def of(cls, request: web.Request, response: web.StreamResponse) -> DirectChunks | None:
        """For ``response`` (prepared, its headers sent), or None where it is not chunked and
        uncompressed (aiohttp's framing would not be the one written here)."""
        transport = request.transport
        if transport is None or not response.prepared or not response.chunked or response.compression:
            return None
        return cls(transport)

    def ready(self) -> bool:
        transport = self._transport
        return not transport.is_closing() and transport.get_write_buffer_size() == 0

    def write(self, data: bytes) -> None:
        """``data`` as one chunk (nothing for no data: an empty chunk would end the body)."""
        if data:
            self._transport.write(b"%x\r\n%s\r\n" % (len(data), data))


def dumps(data: Any) -> bytes:
    """``data`` as compact JSON in UTF-8: orjson, or Python's json for what orjson does not write
    (an integer beyond 64 bits a Responses object repeats from its request)."""
    try:
        return orjson.dumps(data)
    except TypeError:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def json_answer(data: Any, status: int = 200) -> web.Response:
    """A JSON response."""
    return web.Response(body=dumps(data), status=status, content_type="application/json")


def sse_events(events: Sequence[tuple[str | None, Any]]) -> bytes:
    """Server-sent events as written, each an ``event:`` name (None: none) and its data
    (JSON-encoded unless it is already a string, or bytes: JSON already written, ``JsonSlot``)."""
    if len(events) == 1:  # a streamed delta's one event
        name, data = events[0]
        if not name:
            if type(data) is bytes:
                return b"data: " + data + b"\n\n"
            return b"data: " + (data.encode() if isinstance(data, str) else dumps(data)) + b"\n\n"
    out = bytearray()
    for name, data in events:
        if name:
            out += b"event: " + name.encode() + b"\n"
        if type(data) is bytes:
            out += b"data: " + data + b"\n\n"
        else:
            out += b"data: " + (data.encode() if isinstance(data, str) else dumps(data)) + b"\n\n"
    return bytes(out)


#: What stands for the one string a ``JsonSlot`` fills (control characters: JSON escapes them).
SLOT = "\x01\x02slot\x03"
_SLOT_JSON = orjson.dumps(SLOT)


class JsonSlot:
    """The JSON of an object that a stream sends once per delta with only one string changed,
    written once: ``fill(value)`` is byte for byte what ``dumps`` writes for the object with
    ``value`` where it holds ``SLOT``, at the cost of writing ``value`` alone (a streamed
    token's event, without a dictionary built and written per token). None from ``of`` where
    ``SLOT`` is not there exactly once, or the object is one ``dumps`` writes with Python's json."""

    __slots__ = ("head", "tail")

    def __init__(self, head: bytes, tail: bytes) -> None:
        self.head = head
        self.tail = tail

    @classmethod
    def of(cls, data: Any) -> JsonSlot | None:
        try:
            written = orjson.dumps(data)
        except TypeError:
            return None
        parts = written.split(_SLOT_JSON)
        return cls(parts[0], parts[1]) if len(parts) == 2 else None

    def fill(self, value: str) -> bytes:
        return self.head + dumps(value) + self.tail


#: Every surface is served under the rollout's base URL and under the rollout-less prefix.
PREFIXES = ("/rollouts/{rollout}/v1", "/v1")


def add_post(app: web.Application, path: str, handler: Handler) -> None:
    """A model-call route under both prefixes, counted by the app's ``Admission``."""

    async def admitted(request: web.Request) -> web.StreamResponse:
        admission = request.app[ADMISSION]
        admission.enter()
        try:
            # A call in flight keeps its rollout alive (an external runner's lease), however
            # long it waits at the closed gate; its end is a sign of life too.
            active = rollout_of(request)
            active.busy += 1
            try:
                return await handler(request)
            finally:
                active.busy -= 1
                active.last_seen = time.monotonic()
        finally:
            admission.leave()

    for prefix in PREFIXES:
        app.router.add_post(prefix + path, admitted)


def add_get(app: web.Application, path: str, handler: Handler) -> None:
    for prefix in PREFIXES:
        app.router.add_get(prefix + path, handler)


def user_agent(request: web.Request) -> str:
    """The client's User-Agent as recorded: bytes that are not UTF-8 become U+FFFD (aiohttp
    hands them over as surrogate escapes, which the event log cannot store)."""
    agent = request.headers.get("User-Agent", "")
    if agent.isascii():
        return agent
    try:
        raw = agent.encode("utf-8", "surrogateescape")  # the bytes as they came
    except UnicodeEncodeError:
        raw = agent.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")
