"""The harness contract: run one agent on one task against one rollout's base URL.

Owns ``Task``, ``ClientConfig`` (what an agent needs to reach the proxy), the
``HarnessAdapter`` protocol and the two failures an adapter raises on purpose. An adapter knows
how to start and wait for a kind of agent; it knows nothing about tokens, training or the store.

How a rollout ends is said by how ``run`` ends:

* it returns: the agent finished. A float is the rollout's reward (from a verifier, a reward
  function, or the agent); ``None`` means the agent reported its reward over HTTP, or none.
* ``AgentFailed``: the agent itself failed (a nonzero exit, an exception, a failed Job). The
  message carries the reason, e.g. the tail of its stderr. Retrying would not help.
* ``InfraError``: the machinery around the agent failed (an executable missing, no disk for the
  working directory, the Kubernetes API unreachable). ``started`` says whether the agent had
  begun and may have made model calls; a rollout whose agent never started can be retried as
  it is, one whose agent started should be recorded as failed (its calls are partial).
* any other exception is a bug or a configuration error (``ConfigError``) and is recorded.

Cancellation (the controller's timeout, or the appliance stopping) must leave nothing running:
every adapter stops what it started before the ``CancelledError`` leaves ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: Characters of a failure's detail (e.g. a stderr tail) kept in its message. The controller
#: records the last 2,000 characters of ``"<type>: <message>"``, so this leaves room for both.
DETAIL_CHARS = 1500


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Everything an agent needs to call the model through the proxy for one rollout."""

    rollout_id: str
    #: OpenAI-compatible base URL, e.g. ``http://127.0.0.1:8640/rollouts/<id>/v1``.
    base_url: str
    #: The rollout's own API key (only valid for this rollout).
    api_key: str
    #: ``POST {"reward": float}`` here to report the rollout's reward.
    reward_url: str
    model: str
    #: A Unix socket on this machine that serves this rollout's endpoint and nothing else (the
    #: proxy's, for a sandboxed rollout without a network); None: reach ``base_url`` directly.
    endpoint_socket: str | None = None


def tail(text: str, limit: int = DETAIL_CHARS) -> str:
    """The last ``limit`` characters of ``text``, marked as cut when they are not all of it."""
    text = text.rstrip()
    return text if len(text) <= limit else "..." + text[-limit:]


class AgentFailed(Exception):
    """The agent ran but failed; the message (e.g. a stderr tail) is recorded with the rollout."""

    def __init__(self, reason: str, *, detail: str = "") -> None:
        self.reason = reason
        self.detail = tail(detail) if detail else ""
        super().__init__(f"{reason}\n{self.detail}" if self.detail else reason)


class InfraError(Exception):
    """The infrastructure around the agent failed, not the agent: retryable while not started."""

    def __init__(self, reason: str, *, started: bool = False) -> None:
        self.reason = reason
        #: Whether the agent had started (and may have called the model) when this happened.
        self.started = started
        super().__init__(reason)


@runtime_checkable
class HarnessAdapter(Protocol):
    name: str

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        """Run the agent to completion; return its reward, or None if it reported one itself."""
        ...
