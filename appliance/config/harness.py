"""The ``[harness]`` section: which agent and adapter run the rollouts, the task set, and how
rollouts are bounded (the rollout controller reads it). It does not own the adapters
(``harness_adapters``) nor the rollouts (``appliance.rollouts``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config.checks import at_least, seconds
from contracts.errors import ConfigError

SANDBOX_SETTINGS = ("auto", "bwrap", "container", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class HarnessConfig:
    """The agents and their tasks: which harness runs them, the task set, and how rollouts are
    bounded (the rollout controller reads this section)."""

    #: Agent to run, as "package.module:function" for the python adapter.
    agent: str = "harness_adapters.examples.retry_arithmetic:agent"
    #: Harness adapter: a TOML table (``[adapter]``, or ``[harness.adapter]``) with ``adapter =
    #: "command" | "python" | "mini-swe-agent" | "kubernetes" | "external" | "<dotted path>"`` and
    #: its options (see harness_adapters/README.md); or JSON in APPLIANCE_ADAPTER (a bare name,
    #: ``APPLIANCE_ADAPTER=external``, is an adapter without options). None: the python adapter
    #: running ``agent``.
    adapter: dict[str, Any] | None = None
    #: Task set on disk (JSONL, Parquet, a directory of them, or a datasets directory); None:
    #: the built-in arithmetic tasks.
    tasks: Path | None = None
    #: Which split of ``tasks`` to train on, and the fraction held out when it has no splits.
    task_split: str = "train"
    validation_fraction: float = 0.0
    #: Agents running at once (None: no limit beyond the scheduler's admissions); waiting for a
    #: slot does not count against the rollout timeout.
    max_concurrent_agents: int | None = None
    #: Retries of infrastructure failures that happened before an agent started.
    infra_retries: int = 2
    #: Seconds a rollout may run before it is failed.
    rollout_timeout_s: float = 300.0
    #: External runners (adapter "external"): seconds a claimed rollout may go without a sign of
    #: life from its runner (a model call, a reward, a heartbeat) before it is failed.
    runner_lease_s: float = 300.0
    #: External runners: seconds ``POST /admin/rollouts`` waits for the scheduler to offer a
    #: rollout before it answers 503 with Retry-After.
    runner_claim_wait_s: float = 30.0
    # -- refused model calls (appliance.rollouts.controller) --
    #: A rollout more than this fraction of whose model calls the proxy refused (answered with
    #: an error: a prompt past the context, a malformed request; a retryable 429/503 is left
    #: out) is failed, never trained; one all of whose calls were refused, or that made none,
    #: always is (1.0: only those).
    max_refused_fraction: float = 0.5
    # -- sandboxes (harness_adapters.sandbox; appliance.rollouts.sandboxing) --
    #: Where the agents and verifiers of the process adapters (command, mini-swe-agent, python
    #: with isolation "process") run: "bwrap" (bubblewrap: own namespaces, only the rollout's
    #: directory writable, no network but the rollout's endpoint), "container" (the task's
    #: image_name under podman or docker), "none" (on the host as the appliance's user), or
    #: "auto": bwrap where it runs, else refuse to start naming what to install.
    sandbox: str = "auto"
    #: Let sandboxed rollouts reach the network (a task set that needs it); the admin API and
    #: the data directory stay out of reach.
    allow_network: bool = False
    #: Limits of one sandboxed rollout as a whole (all its processes): memory in MiB (swap
    #: included), processes and threads at once, CPUs' worth of time (None: no cap), and the
    #: disk its directory may take in MiB (also its /tmp's size). None: no limit.
    sandbox_memory_mb: int | None = 8192
    sandbox_processes: int | None = 1024
    sandbox_cpus: float | None = None
    sandbox_disk_mb: int | None = 20480

    def __post_init__(self) -> None:
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"validation_fraction must be in [0, 1); got {self.validation_fraction}")
        at_least("max_concurrent_agents", self.max_concurrent_agents, 1)
        at_least("infra_retries", self.infra_retries, 0)
        seconds("rollout_timeout_s", self.rollout_timeout_s)
        seconds("runner_lease_s", self.runner_lease_s)
        seconds("runner_claim_wait_s", self.runner_claim_wait_s)
        if self.sandbox not in SANDBOX_SETTINGS:
            raise ConfigError(f"sandbox must be one of {', '.join(SANDBOX_SETTINGS)}; got {self.sandbox!r}")
        at_least("sandbox_memory_mb", self.sandbox_memory_mb, 16)
        at_least("sandbox_processes", self.sandbox_processes, 4)
        at_least("sandbox_disk_mb", self.sandbox_disk_mb, 1)
        if self.sandbox_cpus is not None and not self.sandbox_cpus > 0:
            raise ConfigError(f"sandbox_cpus must be above 0; got {self.sandbox_cpus}")
        if not 0.0 <= self.max_refused_fraction <= 1.0:
            raise ConfigError(f"max_refused_fraction must be in [0, 1]; got {self.max_refused_fraction}")

    def adapter_spec(self) -> dict[str, Any]:
        """What ``harness_adapters.registry.load_adapter`` builds: ``adapter``, or the python
        adapter running ``agent``."""
        return self.adapter or {"adapter": "python", "agent": self.agent}
