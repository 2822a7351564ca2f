"""The live rollouts the proxy serves: identity, credentials and render state.

Owns the in-memory registry of rollouts that are running now. The event log is the truth about
what rollouts exist and how they ended; this registry only holds what must not be logged (each
rollout's secret token) and what is cheap to lose (the incremental render state). A restart
empties it, and the appliance fails the rollouts that were in flight.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any

from appliance.chat.render import Conversation
from appliance.chat.tokenizer import Tokenizer
from appliance.errors import NotFound, Unauthorized


@dataclass(slots=True)
class ActiveRollout:
    rollout: str
    task_id: str
    group: str
    token: str
    conversation: Conversation
    task: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    reward: float | None = None


class RolloutRegistry:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._active: dict[str, ActiveRollout] = {}

    def register(self, rollout: str, *, task_id: str, group: str, task: dict[str, Any]) -> ActiveRollout:
        active = ActiveRollout(
            rollout=rollout,
            task_id=task_id,
            group=group,
            token="la-" + secrets.token_urlsafe(24),
            conversation=Conversation(self._tokenizer),
            task=task,
        )
        self._active[rollout] = active
        return active

    def unregister(self, rollout: str) -> None:
        self._active.pop(rollout, None)

    def __len__(self) -> int:
        return len(self._active)

    def get(self, rollout: str) -> ActiveRollout | None:
        return self._active.get(rollout)

    def authorize(self, rollout: str, token: str | None) -> ActiveRollout:
        """The rollout if it is live and ``token`` is its own; 404 or 401 otherwise."""
        active = self._active.get(rollout)
        if active is None:
            raise NotFound(f"rollout {rollout!r} does not exist or has already finished")
        if not token or not hmac.compare_digest(token.encode(), active.token.encode()):
            raise Unauthorized(f"the API key is not valid for rollout {rollout!r}")
        return active
