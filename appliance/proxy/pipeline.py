"""The one shape every API surface speaks to the call path, and the contract a surface fulfils.

Owns ``CallRequest`` (what a request body asks for, once its surface has read and validated
it: prompts, sampling, stop strings, choices, streaming, log-probs), ``Answer`` (one finished
choice, its log-probs already decoded to text) and the two protocols a surface implements:
``Surface`` (body -> ``CallRequest``; answers -> the API's whole response) and
``StreamEncoder`` (text deltas and the final answer -> the API's server-sent events). Both are
pure: no I/O, no tokens. ``appliance.proxy.driver`` runs every surface through them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.chat.messages import Message
from appliance.engines.base import SamplingParams
from appliance.proxy.http import ProxySettings
from contracts.errors import ApplianceError


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation to render with the chat template; ``tools`` are shown to the model."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()


#: A Completions prompt: text (continued from the rollout's transcript when it extends it) or
#: token ids taken as they are.
TextPrompt = str | tuple[int, ...]
Prompt = ChatPrompt | TextPrompt


@dataclass(frozen=True, slots=True)
class Structure:
    """An output the client requires, enforced by constrained decoding (``response_format``,
    a forced ``tool_choice``): ``json_object``, ``json_schema`` (with ``schema``) or
    ``tool_call`` (one call of ``tool``; None: one or more calls of any declared tool)."""

    kind: str
    schema: Mapping[str, Any] | None = None
    tool: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRequest:
    """A validated request: ``n`` choices for each prompt, sampled with ``params``."""

    surface: str
    model: str
    prompts: tuple[Prompt, ...]
    params: SamplingParams
    #: The request as the client sent it (recorded with each call).
    body: Mapping[str, Any]
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    #: Decode the sampled tokens' log-probs (with ``params.top_logprobs`` alternatives each).
    logprobs: bool = False
    #: Also the prompt's log-probs (with this many alternatives each), for Completions' echo.
    prompt_logprobs: int | None = None
    #: Streamed: a last event with the usage (``stream_options.include_usage``).
    include_usage: bool = False
    #: The output's required form, if any (the driver turns it into the engine's grammar).
    structure: Structure | None = None
    #: The client set no completion length (and the config sets no default): a prompt that
    #: leaves less room than ``params.max_tokens`` gets what room there is instead of a 400.
    fit_context: bool = False
    #: The completion length the request asked for (None: none), before ``max_tokens_cap``:
    #: an overflow says what the cap made of it.
    max_tokens_asked: int | None = None
    #: What only this surface's shapes need (Completions' ``echo``, the fields a Responses object
    #: repeats), passed back to it untouched.
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token as text with its log-prob (None: the first prompt token has none) and the most
    likely alternatives at its position."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """One finished choice, as a surface renders it."""

    #: Index among all choices (prompt-major), and of its prompt.
    index: int
    prompt_index: int
    call_id: str
    message: Message
    #: The sampled text, cut before a stop string (tool-call blocks included).
    text: str
    #: "stop", "length" (the engine's) or "cancelled".
    finish_reason: str
    #: The stop string the text was cut before, if one matched.
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    policy_version: int
    #: A Completions prompt as text (what ``echo`` repeats); None for chat.
    prompt_text: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def truncated(self) -> bool:
        """Cut at the completion limit."""
        return self.finish_reason == "length"


@dataclass(frozen=True, slots=True)
class Started:
    """What is known of a streamed call before its first token."""

    call_id: str
    prompt_tokens: int
    #: A Completions prompt as text (for ``echo``); None for chat.
    prompt_text: str | None = None
    #: The model writes ``<think>`` reasoning before its answer.
    reasoning: bool = False


#: One server-sent event: its ``event:`` name (None: none) and its data (JSON-encoded unless a
#: string such as ``[DONE]``, or bytes: JSON already written, ``appliance.proxy.http.JsonSlot``).
Event = tuple[str | None, Any]


class StreamEncoder(Protocol):
    """One streamed call in an API's events. Generation is under way when it is made."""

    def opening(self) -> list[Event]:
        """The events sent as soon as the headers are out (before the first token)."""
        ...

    def text(self, delta: str) -> list[Event]:
        """Events for newly sampled text (already held back where it may be a stop string or the
        start of a tool call)."""
        ...

    def closing(self, answer: Answer) -> list[Event]:
        """Events for the finished (and durable) call."""
        ...

    def failed(self, error: ApplianceError) -> list[Event]:
        """The error, after the status line is gone, as the API sends it in a stream."""
        ...

    def trailer(self) -> list[Event]:
        """What ends the stream, success or not (OpenAI's ``[DONE]``)."""
        ...


class Surface(Protocol):
    """An API surface: reads its bodies and writes its responses, nothing else."""

    #: The surface's name in the call events (``openai.chat``, ...).
    name: str

    def parse(self, body: dict[str, Any], settings: ProxySettings) -> CallRequest:
        """Validate ``body``; ``BadRequest`` naming the parameter otherwise."""
        ...

    def whole(self, request: CallRequest, answers: Sequence[Answer]) -> dict[str, Any]:
        """The whole (non-streamed) response for the finished choices, in order."""
        ...

    def encoder(self, request: CallRequest, started: Started) -> StreamEncoder:
        """The event writer of the one streamed choice."""
        ...
