"""The ``external`` adapter: rollouts run by runners the appliance did not start.

Owns the adapter that starts nothing. A runner elsewhere (another machine, a cluster's job
system, a notebook) claims a rollout over HTTP (``POST /admin/rollouts``), calls the model at the
rollout's base URL, reports its reward and finishes it (``harness_adapters.runner`` is a client
for all of that). The appliance attaches its board of offered rollouts
(``appliance.rollouts.external.RunnerBoard``) to this adapter when it starts; ``run`` hands each
rollout to it and returns when its runner finishes it (None: the reward came over HTTP), or
raises ``AgentFailed`` when the runner failed it or went silent past its lease.

Select it with ``[adapter] adapter = "external"`` (TOML) or ``APPLIANCE_ADAPTER=external``.
"""

from __future__ import annotations

from typing import Protocol

from contracts.errors import ConfigError
from harness_adapters.base import ClientConfig, Task


class RolloutBoard(Protocol):
    """Where the adapter's rollouts wait for their runners (the appliance's ``RunnerBoard``)."""

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        """Offer the rollout and wait until its runner ends it."""
        ...


class ExternalAdapter:
    name = "external"

    def __init__(self) -> None:
        #: Set by the appliance when it starts (``appliance.rollouts.external.attach``).
        self.board: RolloutBoard | None = None

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        if self.board is None:
            raise ConfigError(
                "the external adapter runs rollouts only inside an appliance, which offers them to "
                "runners (POST /admin/rollouts)"
            )
        return await self.board.run(task, client)
