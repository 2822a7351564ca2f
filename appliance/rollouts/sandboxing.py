"""Where a run's agents run: ``[harness] sandbox`` resolved for the run's adapter, in one line.

Owns turning the harness section's sandbox settings into what the run does with them: for the
adapters that start agent processes (``command``, ``mini-swe-agent``, ``python`` with
``isolation = "process"``) the sandbox kind ("auto" made concrete: bubblewrap where it runs,
else a refused start naming the package to install or ``sandbox = "none"``) and the options the
adapter gets (the limits, the network, the data directory hidden); whether the proxy opens a
socket per rollout (a sandbox without a network reaches its endpoint through it); and the one
line the startup, ``status``, ``doctor`` and the dashboard say about it ("agents run
unsandboxed" where they do). The in-process ``python`` adapter runs agents inside the
appliance: no sandbox can hold it, and the line says so and how to get one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import ApplianceConfig, HarnessConfig
from contracts.errors import ConfigError
from harness_adapters.base import HarnessAdapter
from harness_adapters.registry import ALIASES, load_adapter, makes_rollout_dirs
from harness_adapters.sandbox import Sandbox, SandboxKind, SandboxUnavailable, resolve_kind

log = logging.getLogger(__name__)

UNSANDBOXED = "agents run unsandboxed"


@dataclass(frozen=True, slots=True)
class AgentIsolation:
    """What the run does about its agents' confinement."""

    #: The sandbox of the process adapters ("none" for the others).
    kind: SandboxKind
    #: One line: where the agents run and what holds them.
    line: str
    #: Options added to the adapter's (its own win): the sandbox and its limits.
    adapter_options: dict[str, Any]
    #: The proxy serves each rollout on a socket of its own (a sandbox without a network).
    endpoint_sockets: bool

    @property
    def unsandboxed(self) -> bool:
        return self.line.startswith(UNSANDBOXED)


def _adapter(harness: HarnessConfig) -> tuple[str, dict[str, Any]]:
    spec = dict(harness.adapter_spec())
    name = str(spec.pop("adapter", None) or spec.pop("name", "python"))
    return ALIASES.get(name, name), spec


def runs_processes(harness: HarnessConfig) -> bool:
    """Whether the run's adapter starts agent processes (the ones a sandbox holds)."""
    return makes_rollout_dirs(*_adapter(harness))


def describe(harness: HarnessConfig, kind: str | None = None) -> str:
    """The line for ``harness`` whose sandbox is ``kind`` (default: its own setting, resolved)."""
    name, options = _adapter(harness)
    if makes_rollout_dirs(name, options):
        chosen = str(options.get("sandbox") or kind or harness.sandbox)
        if chosen == "none":
            return f'{UNSANDBOXED} (sandbox = "none"): they can read and write what the appliance\'s user can'
        allow = bool(options.get("allow_network", harness.allow_network))
        policy = Sandbox(kind="container" if chosen == "container" else "bwrap", allow_network=allow)
        return policy.describe()
    if name == "python":
        return (
            f"{UNSANDBOXED}: the python adapter runs agents inside the appliance's process "
            '(isolation = "process" runs each in a sandbox)'
        )
    if name == "kubernetes":
        return "agents run as Kubernetes Jobs (isolated by the cluster, not by the appliance)"
    if name == "external":
        return "agents run in external runners (started and isolated elsewhere)"
    return f"agents run as adapter {name!r} runs them (not sandboxed by the appliance)"


def resolve(config: ApplianceConfig) -> AgentIsolation:
    """The run's isolation; a ``ConfigError`` (one line) where the sandbox asked for cannot run."""
    harness = config.harness
    name, options = _adapter(harness)
    if not makes_rollout_dirs(name, options):
        return AgentIsolation("none", describe(harness), {}, endpoint_sockets=False)
    setting = str(options.get("sandbox") or harness.sandbox)
    try:
        kind = resolve_kind(setting)  # type: ignore[arg-type]  # checked by HarnessConfig
    except SandboxUnavailable as exc:
        raise ConfigError(str(exc)) from None
    allow = bool(options.get("allow_network", harness.allow_network))
    adapter_options: dict[str, Any] = {
        "sandbox": kind,
        "allow_network": allow,
        "sandbox_memory_mb": harness.sandbox_memory_mb,
        "sandbox_processes": harness.sandbox_processes,
        "sandbox_cpus": harness.sandbox_cpus,
        "sandbox_disk_mb": harness.sandbox_disk_mb,
        # Never visible to an agent, whatever else the config lets it read.
        "hidden_paths": [config.data_dir.resolve()],
    }
    if name == "python":  # its options go to the command adapter it runs the worker with
        adapter_options = {k: v for k, v in adapter_options.items() if k not in options}
    return AgentIsolation(
        kind, describe(harness, kind), adapter_options, endpoint_sockets=kind != "none" and not allow
    )


def start(config: ApplianceConfig) -> tuple[AgentIsolation, ApplianceConfig]:
    """The run's isolation (logged; ``up`` prints its line once, the dashboard shows it) and its
    config with the sandbox made concrete; a one-line ``ConfigError`` where it cannot run."""
    isolation = resolve(config)
    log.info("%s", isolation.line)
    return isolation, with_resolved_sandbox(config, isolation)


def load_run_adapter(config: ApplianceConfig, isolation: AgentIsolation) -> HarnessAdapter:
    """The run's adapter: rollout directories under the data directory, and the isolation's
    options (a sandbox and its limits) for the adapters that start processes."""
    return load_adapter(
        config.harness.adapter_spec(),
        workdir_root=config.data_dir / "rollouts",
        process_defaults=isolation.adapter_options,
    )


def with_resolved_sandbox(config: ApplianceConfig, isolation: AgentIsolation) -> ApplianceConfig:
    """``config`` with ``sandbox`` = the kind the run uses (what the log records and ``status``
    reads back), "auto" made concrete."""
    if not makes_rollout_dirs(*_adapter(config.harness)):
        return config
    harness = dataclasses.replace(config.harness, sandbox=isolation.kind)
    return dataclasses.replace(config, harness=harness)


def recorded_line(recorded: Mapping[str, Any]) -> str | None:
    """The line for a run from its recorded config (``ApplianceStarted.config``); None when it
    cannot be read back (a config of a version without these fields says nothing)."""
    section = recorded.get("harness")
    if not isinstance(section, Mapping):
        return None
    fields = {f.name for f in dataclasses.fields(HarnessConfig)}
    known = {k: v for k, v in section.items() if k in fields}
    if "tasks" in known and known["tasks"] is not None:
        known["tasks"] = Path(str(known["tasks"]))
    try:
        return describe(HarnessConfig(**known))
    except (ConfigError, TypeError):
        return None
