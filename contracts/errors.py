"""The appliance's error hierarchy, and each error's shape on the wire.

Owns every exception the appliance raises on purpose. Each carries a message a person can act
on, plus the HTTP status and OpenAI error ``type``/``code`` the proxy answers with, and knows
its own body in both wire dialects (``to_openai``, ``to_anthropic``), so the middleware and
every stream that fails after its headers went out answer with the same shapes. Unexpected
exceptions are not listed here: the proxy answers them with a 500 and logs them. Also owns
:func:`disk_full`, which tells a full disk (an OS error however deep in a chain, or ``StoreFull``)
from the other failures.

This module is the bottom of the import graph: it imports nothing from the project, so the
store, the trainer, the harness adapters and the dashboard can raise these without importing
anything else of the appliance (tests/test_layers.py holds it to that).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

#: Anthropic's error ``type`` by HTTP status (its API's own list).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ApplianceError(Exception):
    """Base of all deliberate errors."""

    status: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init_subclass__(
        cls, *, status: int | None = None, error_type: str | None = None, code: str | None = None
    ) -> None:
        """A subclass states its wire form in its header: ``class X(ApplianceError, status=404)``."""
        super().__init_subclass__()
        if status is not None:
            cls.status = status
        if error_type is not None:
            cls.error_type = error_type
        if code is not None:
            cls.code = code

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def anthropic_message(self) -> str:
        """The message as the Anthropic surface words it (the same text unless a subclass knows
        the wording Anthropic's own API uses, which clients match on)."""
        return self.message

    #: Seconds a client should wait before retrying (sent as ``Retry-After``); None: not said.
    retry_after_s: int | None = None

    def openai_error(self) -> dict[str, Any]:
        """The ``error`` object of OpenAI's APIs (also what a failed OpenAI stream sends)."""
        return {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}

    def to_openai(self) -> dict[str, Any]:
        """The body OpenAI's APIs answer an error with: ``{"error": {...}}``."""
        return {"error": self.openai_error()}

    def to_anthropic(self) -> dict[str, Any]:
        """The body Anthropic's API answers an error with (also its stream's ``error`` event)."""
        default = "invalid_request_error" if self.status < 500 else "api_error"
        kind = _ANTHROPIC_TYPES.get(self.status, default)
        return {"type": "error", "error": {"type": kind, "message": self.anthropic_message}}


class HTTPError(ApplianceError):
    """An HTTP-level failure outside any handler's own errors (no such route, body too large,
    an unexpected exception answered as a 500), in the same shapes as the deliberate ones."""

    def __init__(self, status: int, message: str, code: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = "invalid_request_error" if status < 500 else "server_error"
        self.code = code


class ConfigError(ApplianceError, status=400, error_type="invalid_request_error", code="invalid_config"):
    """The configuration or command line is invalid."""


class PreflightFailed(ConfigError, code="preflight_failed"):
    """A start was refused before anything loaded: the data directory is locked by another
    appliance or not writable, the port is taken, the disk is full, or the run on disk was
    trained with another model (see ``appliance.operations.preflight``)."""


class BadRequest(ApplianceError, status=400, error_type="invalid_request_error", code="invalid_request"):
    """The client sent something the proxy cannot serve (bad JSON, wrong types, missing fields)."""


class ContextTooLong(BadRequest, code="context_length_exceeded"):
    """Prompt plus requested completion exceed the model's context.

    Worded, typed and placed on each surface as the API it imitates answers the same request,
    because clients recognise the overflow by its text or code (litellm's
    ``ContextWindowExceededError``, langchain, aider, mini-swe-agent, Claude Code) and react by
    trimming the conversation. The wording also says which part overflowed: a prompt that alone
    exceeds the context (trimming helps) is told apart from one that fits but leaves less room
    than the requested completion (only a smaller ``max_tokens`` may help), as OpenAI's chat
    completions and Anthropic's Messages tell them apart. ``surface`` is the proxy surface's
    name (``openai.chat``, ``openai.completions``, ``openai.responses``, ``anthropic.messages``).

    ``code`` stays ``context_length_exceeded`` on the error itself; the OpenAI body carries what
    the real API sends, which for the legacy completions endpoint is ``code`` and ``param`` null.

    ``asked_tokens`` is the completion length the request asked for where a limit (``capped_by``,
    the appliance's ``max_tokens_cap`` unless said otherwise) made it ``completion_tokens``: the
    numbers above are the capped ones (clients compute a smaller length from them), and a
    sentence after them says what was asked and what the limit made of it."""

    def __init__(
        self,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        max_context: int,
        surface: str = "openai.chat",
        asked_tokens: int | None = None,
        capped_by: str = "the appliance's max_tokens_cap",
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.max_context = max_context
        self.surface = surface
        self.asked_tokens = asked_tokens
        self.capped_by = capped_by
        capped = self._capped()
        message = self._openai_message() + (f" {capped}." if capped else "")
        super().__init__(message, param=_OVERFLOW_PARAMS.get(surface, "messages"))

    def _capped(self) -> str:
        """What the request asked and what a limit made of it; empty where nothing was capped
        (or the prompt alone overflows, which no length changes)."""
        asked = self.asked_tokens
        if asked is None or asked == self.completion_tokens or self.prompt_alone_exceeds:
            return ""
        return (
            f"{asked} completion tokens were asked for; {self.capped_by} made that {self.completion_tokens}"
        )

    @property
    def prompt_alone_exceeds(self) -> bool:
        """Whether the prompt alone is longer than the context (no completion length fits it)."""
        return self.prompt_tokens > self.max_context

    def _openai_message(self) -> str:
        limit, prompt, completion = self.max_context, self.prompt_tokens, self.completion_tokens
        if self.surface == "openai.completions":
            return (
                f"This model's maximum context length is {limit} tokens, however you requested "
                f"{prompt + completion} tokens ({prompt} in your prompt; {completion} for the "
                "completion). Please reduce your prompt; or completion length."
            )
        if self.prompt_alone_exceeds and self.surface == "openai.responses":
            return (
                "Your input exceeds the context window of this model. Please adjust your input and try again."
            )
        if self.prompt_alone_exceeds:
            return (
                f"This model's maximum context length is {limit} tokens. However, your messages "
                f"resulted in {prompt} tokens. Please reduce the length of the messages."
            )
        return (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the "
            "completion). Please reduce the length of the messages or completion."
        )

    def openai_error(self) -> dict[str, Any]:
        error = super().openai_error()
        if self.surface == "openai.completions":
            error["code"] = None
        return error

    @property
    def anthropic_message(self) -> str:
        if self.prompt_alone_exceeds:
            return f"prompt is too long: {self.prompt_tokens} tokens > {self.max_context} maximum"
        return (
            "input length and `max_tokens` exceed context limit: "
            f"{self.prompt_tokens} + {self.completion_tokens} > {self.max_context}, "
            "decrease input length or `max_tokens` and try again"
            + (f" ({capped})" if (capped := self._capped()) else "")
        )


#: The request field an overflow is charged to, per surface, as the real APIs name it.
_OVERFLOW_PARAMS: dict[str, str | None] = {
    "openai.chat": "messages",
    "openai.completions": None,
    "openai.responses": "input",
    "anthropic.messages": "messages",
}


class Unauthorized(ApplianceError, status=401, error_type="authentication_error", code="invalid_api_key"):
    """The token is missing or belongs to another rollout."""


class Forbidden(ApplianceError, status=403, error_type="permission_error", code="forbidden"):
    """The credentials are fine but the route is not for this caller (a sandboxed rollout's
    socket asking for another route than its own)."""


class NotFound(ApplianceError, status=404, error_type="not_found_error", code="not_found"):
    """The rollout (or route) does not exist."""


class ModelNotFound(NotFound, error_type="invalid_request_error", code="model_not_found"):
    """A model id the appliance does not serve (it serves one); worded and typed as OpenAI's."""


class Conflict(ApplianceError, status=409, error_type="invalid_request_error", code="conflict"):
    """The request is valid but the target's state forbids it (e.g. a finished rollout)."""


class Overloaded(ApplianceError, status=429, error_type="rate_limit_error", code="overloaded"):
    """A limit of the appliance is reached (calls held at once, live rollouts); retry later.

    The proxy answers 429 with a ``Retry-After`` header of ``retry_after_s`` seconds."""

    def __init__(self, message: str, *, code: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s: int | None = retry_after_s


class EngineUnavailable(ApplianceError, status=503, error_type="server_error", code="engine_unavailable"):
    """The engine is stopped or failed; the call may be retried."""

    retry_after_s = 1


class ReplicaLost(EngineUnavailable, code="engine_replica_lost"):
    """A remote engine replica was lost (it died, or was cut off) after it had sampled tokens of
    the call: the call ends, and its rollout fails with this message as its reason (its tokens
    came from a replica that cannot finish them)."""


class NothingToClaim(ApplianceError, status=503, error_type="server_error", code="no_rollout_offered"):
    """No rollout was offered to external runners within a claim's wait (the scheduler is
    training, or the staleness bound or a pause holds new groups back); nothing was recorded
    for the claim, and it may be retried after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s: int | None = retry_after_s


class StopForced(ApplianceError, status=503, error_type="server_error", code="stopped"):
    """A stop was forced (a second signal, or the stop's deadline) before the appliance was up."""


class TrainingFailed(ApplianceError, status=500, error_type="server_error", code="training_failed"):
    """The trainer failed the same step several times in a row; the run stops."""


class StoreError(ApplianceError, status=503, error_type="server_error", code="store_unavailable"):
    """The event store could not make an event durable; nothing was acknowledged."""


class StoreFull(StoreError, status=507, code="store_full"):
    """The disk (or the store's size cap) is full: nothing more is durable until space returns."""


class StoreCorrupted(StoreError, status=500, code="store_corrupted"):
    """The event log fails its checksum chain (or has a gap): it was changed outside the appliance."""


#: OS errors that say a disk (or a quota on it) is full.
_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException, directory: Path) -> str | None:
    """``"the disk of <directory> is full: N MiB free"`` when ``exc`` (or an exception it was
    raised from) is a full disk's OS error or the event store's ``StoreFull``, else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StoreFull) or (isinstance(current, OSError) and current.errno in _FULL):
            try:
                free = f"{shutil.disk_usage(directory).free / 2**20:,.0f} MiB free now"
            except OSError:
                free = "its free space unknown"
            return f"the disk of {directory} is full: {free}"
        current = current.__cause__ or current.__context__
    return None
