"""The ``[proxy]`` section: where the proxy listens, the sampling it forces, its limits, the
admin token and the names the policy answers to (``ProxySettings.from_config`` reads it).
It does not own serving (``appliance.proxy``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.config.checks import at_least, seconds
from contracts.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    """The proxy the agents call: where it listens, the sampling it forces, its limits and the
    admin token (``ProxySettings.from_config`` adds the served model's name)."""

    #: Address the proxy binds to; loopback unless you mean to expose it.
    host: str = "127.0.0.1"
    #: Port of the proxy (0 picks a free one).
    port: int = 8640
    #: Completion length of a call that asks for none, in tokens (None: what the model's context
    #: leaves after the prompt, up to max_tokens_cap: agents that send no limit are not cut off).
    max_tokens: int | None = None
    #: The most tokens any call may generate, whatever it asks.
    max_tokens_cap: int = 2048
    #: Sampling temperature forced for training calls (None: what the client asks).
    temperature: float | None = 1.0
    #: Seconds a call may wait while the machine trains before it gets a retryable 503.
    hold_timeout_s: float = 3600.0
    #: Live rollouts at most; registering one more fails with a 429 (too_many_rollouts).
    max_rollouts: int = 4096
    #: Model calls the proxy holds at once (waiting while training, queued in the engine,
    #: generating, streaming); one more is refused at once with a 429 and Retry-After.
    max_queued_calls: int = 4096
    #: Largest request body the proxy reads, in bytes; a larger one gets a 413.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Token for the admin API and the rollout-less /v1 routes (None: generated once into
    #: <data_dir>/admin_token).
    admin_token: str | None = None
    # --- served model names ---
    #: Names the policy answers to, as vLLM's --served-model-name (e.g. ["gpt-4o-mini",
    #: "claude-sonnet-4-5"]; in the environment, comma-separated): GET /models lists them all,
    #: GET /models/{name} answers each, and the first is the name harnesses are given ({model},
    #: $LA_MODEL, a runner's claim). Empty: the model's own name. Calls naming any model are
    #: answered by the policy whatever this says; each is recorded with the name it asked for.
    served_model_names: tuple[str, ...] = ()
    # --- Prometheus metrics ---
    #: GET /metrics answers clients on this host (loopback) without the admin token, for a
    #: Prometheus running beside the appliance; from any other address it still needs the token.
    metrics_public: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be a port number (0: a free one); got {self.port}")
        for name in ("max_tokens", "max_tokens_cap", "max_rollouts", "max_queued_calls", "max_body_bytes"):
            at_least(name, getattr(self, name), 1)
        if self.temperature is not None and not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(
                f"temperature must be 0 or more (or none: the client's); got {self.temperature}"
            )
        seconds("hold_timeout_s", self.hold_timeout_s)
        names = self.served_model_names
        if not isinstance(names, tuple) or not all(
            isinstance(n, str) and n.strip() == n and n for n in names
        ):
            raise ConfigError(f"served_model_names must be a list of non-empty names; got {names!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"served_model_names names a model twice: {list(names)}")

    def served_names(self, model_name: str) -> tuple[str, ...]:
        """The names the policy answers to: ``served_model_names``, else ``model_name`` alone."""
        return self.served_model_names or (model_name,)
