"""The harness contract: run one agent on one task against one rollout's base URL.

Owns ``Task``, ``ClientConfig`` (what an agent needs to reach the proxy) and the
``HarnessAdapter`` protocol. An adapter knows how to start and wait for a kind of agent; it
knows nothing about tokens, training or the store. Failures are exceptions: the rollout
controller records them with their reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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


class AgentFailed(Exception):
    """The agent ran but failed; the message (e.g. a stderr tail) is recorded with the rollout."""


@runtime_checkable
class HarnessAdapter(Protocol):
    name: str

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        """Run the agent to completion; return its reward, or None if it reported one itself."""
        ...
