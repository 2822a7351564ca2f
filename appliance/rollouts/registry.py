"""The live rollouts the proxy serves: identity, credentials and render state.

Owns the in-memory registry of rollouts that are running now. The event log is the truth about
what rollouts exist and how they ended; this registry only holds what must not be logged (each
rollout's secret token) and what is cheap to lose (the incremental render state). A restart
empties it, and the appliance fails the rollouts that were in flight.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.chat.formats import CHATML, ChatFormat
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.transcript import Transcript
from contracts.errors import Conflict, NotFound, Overloaded, Unauthorized


@dataclass(slots=True)
class ActiveRollout:
    rollout: str
    task_id: str
    group: str
    token: str
    #: Everything a later call needs to continue this rollout's earlier ones token for token.
    transcript: Transcript
    task: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    #: Model calls the proxy answered with an error (each recorded as ``LLMCallRefused``), and
    #: the last one's reason in one line (``code: message``): the controller fails a rollout
    #: whose calls were all, or too many of them, refused.
    refused: int = 0
    last_refusal: str = ""
    #: Of ``refused``, the answers a client retries (429, 503: the model held by training past
    #: ``hold_timeout_s``, the engine unavailable, too many calls queued): the availability of the
    #: appliance, not the call's fault, so ``max_refused_fraction`` leaves them out.
    unavailable: int = 0
    #: Why a model call of it ended mid-way (an engine replica lost after it had sampled tokens
    #: of the call, ``ReplicaLost``); the controller fails the rollout with it ("": none did).
    lost: str = ""
    reward: float | None = None
    #: Evaluation sampling of a validation rollout: the temperature and completion length its
    #: calls are served with, whatever the client or the training rules ask (None: no override).
    temperature_override: float | None = None
    max_tokens_override: int | None = None
    #: Signs of life of whoever runs the rollout (an external runner's lease reads them): when an
    #: authorised request on its routes last started or a model call of it last ended
    #: (``time.monotonic()``), and its model calls in flight now.
    last_seen: float = field(default_factory=time.monotonic)
    busy: int = 0


#: Rollout id of calls on the plain ``/v1`` prefix; no ``RolloutCreated`` event names it.
DEFAULT_ROLLOUT = "default"
#: Sampled turns the rollout-less conversation remembers for splicing (the oldest forgotten
#: beyond): it lives as long as the process, whoever calls the plain ``/v1`` routes.
DEFAULT_SAMPLED_TURNS = 4096
#: Ended rollouts whose keys are remembered, so a request after the end is a 409, not a 404.
REMEMBERED_ENDED = 4096


class RolloutRegistry:
    def __init__(
        self,
        tokenizer: Tokenizer,
        fmt: ChatFormat = CHATML,
        max_rollouts: int = 4096,
        on_unregister: Callable[[str], None] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.fmt = fmt
        #: Called with a rollout's id when it leaves the registry (an engine fleet forgets which
        #: replica served it).
        self._on_unregister = on_unregister
        #: Live rollouts at most (the rollout-less default one not counted).
        self.max_rollouts = max_rollouts
        self._active: dict[str, ActiveRollout] = {}
        #: Rollouts that left the registry: id -> key, the newest ``REMEMBERED_ENDED``.
        self._ended: OrderedDict[str, str] = OrderedDict()

    def ensure_room(self, count: int = 1) -> None:
        """Raise ``Overloaded`` (429) unless ``count`` more rollouts fit under ``max_rollouts``."""
        if len(self) + count > self.max_rollouts:
            raise Overloaded(
                f"{len(self)} rollouts are live and at most {self.max_rollouts} may be (max_rollouts); "
                "wait for some to finish",
                code="too_many_rollouts",
                retry_after_s=5,
            )

    def register(self, rollout: str, *, task_id: str, group: str, task: dict[str, Any]) -> ActiveRollout:
        if rollout != DEFAULT_ROLLOUT and rollout not in self._active:
            self.ensure_room()
        active = ActiveRollout(
            rollout=rollout,
            task_id=task_id,
            group=group,
            token="la-" + secrets.token_urlsafe(24),
            transcript=Transcript(
                self._tokenizer,
                self.fmt,
                max_sampled=DEFAULT_SAMPLED_TURNS if rollout == DEFAULT_ROLLOUT else None,
            ),
            task=task,
        )
        self._active[rollout] = active
        self._ended.pop(rollout, None)
        return active

    def unregister(self, rollout: str) -> None:
        active = self._active.pop(rollout, None)
        if active is None:
            return
        if rollout != DEFAULT_ROLLOUT:
            self._ended[rollout] = active.token
            while len(self._ended) > REMEMBERED_ENDED:
                self._ended.popitem(last=False)
        if self._on_unregister is not None:
            self._on_unregister(rollout)

    def __len__(self) -> int:
        return sum(1 for name in self._active if name != DEFAULT_ROLLOUT)

    def default(self) -> ActiveRollout:
        """The rollout-less conversation of the plain ``/v1`` routes (never trained on)."""
        active = self._active.get(DEFAULT_ROLLOUT)
        if active is None:
            active = self.register(DEFAULT_ROLLOUT, task_id="", group="", task={})
        return active

    def get(self, rollout: str) -> ActiveRollout | None:
        return self._active.get(rollout)

    def authorize(self, rollout: str, token: str | None) -> ActiveRollout:
        """The rollout if it is live and ``token`` is its own. A wrong key is a 401; a rollout
        that has ended is a 409 (to its own key) whatever the request (a model call, a reward, a
        heartbeat, a finish); only one this process never ran is a 404."""
        active = self._active.get(rollout)
        if active is None:
            key = self._ended.get(rollout)
            if key is None:
                raise NotFound(f"rollout {rollout!r} does not exist")
            if not token or not hmac.compare_digest(token.encode(), key.encode()):
                raise Unauthorized(f"the API key is not valid for rollout {rollout!r}")
            raise Conflict(
                f"rollout {rollout!r} has already ended; it takes no more model calls, rewards, "
                "heartbeats or finishes"
            )
        if not token or not hmac.compare_digest(token.encode(), active.token.encode()):
            raise Unauthorized(f"the API key is not valid for rollout {rollout!r}")
        active.last_seen = time.monotonic()
        return active
