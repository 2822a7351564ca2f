"""The appliance's error hierarchy.

Owns every exception the appliance raises on purpose. Each carries a message a person can act
on, plus the HTTP status and OpenAI error ``type``/``code`` the proxy answers with, so one
middleware can turn any of them into an OpenAI-shaped error body. Unexpected exceptions are not
listed here: the proxy answers them with a 500 and logs them.
"""

from __future__ import annotations


class ApplianceError(Exception):
    """Base of all deliberate errors."""

    status: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(ApplianceError):
    """The configuration or command line is invalid."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_config"


class BadRequest(ApplianceError):
    """The client sent something the proxy cannot serve (bad JSON, wrong types, missing fields)."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class ContextTooLong(BadRequest):
    """Prompt plus requested completion exceed the model's context."""

    code = "context_length_exceeded"


class Unauthorized(ApplianceError):
    """The token is missing or belongs to another rollout."""

    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ApplianceError):
    """The rollout (or route) does not exist."""

    status = 404
    error_type = "not_found_error"
    code = "not_found"


class Conflict(ApplianceError):
    """The request is valid but the target's state forbids it (e.g. a finished rollout)."""

    status = 409
    error_type = "invalid_request_error"
    code = "conflict"


class EngineUnavailable(ApplianceError):
    """The engine is stopped or failed; the call may be retried."""

    status = 503
    error_type = "server_error"
    code = "engine_unavailable"


class StoreError(ApplianceError):
    """The event store could not make an event durable; nothing was acknowledged."""

    status = 503
    error_type = "server_error"
    code = "store_unavailable"
