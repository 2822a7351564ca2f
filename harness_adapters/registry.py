"""Adapters by name: ``load_adapter("command", command=...)`` or from a config table.

Owns the mapping from an adapter's name to the class that implements it, and building one
from a spec. A spec is a name (``"python"``), a dotted path to a class or factory
(``"my_pkg.harness:MyAdapter"``), or a table ``{"adapter": <name or path>, **options}``, as it
would sit in the appliance's TOML config::

    [adapter]
    adapter = "command"
    command = "my-agent --task {problem_statement}"
    verifier = "pytest -q"
    max_concurrency = 32

Options are checked by each adapter's pydantic config, so a misspelt option is a readable
``ConfigError``, as is an unknown name (which lists the valid ones). The heavy adapters
(``kubernetes``) are imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from contracts.errors import ConfigError
from harness_adapters.base import HarnessAdapter
from harness_adapters.loading import load_object

ADAPTERS: dict[str, str] = {
    "command": "harness_adapters.command:CommandAdapter",
    "python": "harness_adapters.python:PythonAdapter",
    "mini-swe-agent": "harness_adapters.mini_swe:MiniSweAgentAdapter",
    "kubernetes": "harness_adapters.kubernetes:KubernetesAdapter",
    "external": "harness_adapters.external:ExternalAdapter",
}
#: Other spellings people will type.
ALIASES = {"mini_swe_agent": "mini-swe-agent", "mini": "mini-swe-agent", "k8s": "kubernetes"}


def adapter_target(name: str) -> str:
    """The dotted path of the adapter called ``name`` (a dotted path stays as it is)."""
    if ":" in name:
        return name
    key = ALIASES.get(name, name)
    if key not in ADAPTERS:
        raise ConfigError(
            f"unknown adapter {name!r}; valid names: {', '.join(sorted(ADAPTERS))}, "
            "or a dotted path 'package.module:Class'"
        )
    return ADAPTERS[key]


def makes_rollout_dirs(name: str, options: Mapping[str, Any]) -> bool:
    """Whether the adapter ``name`` with these options runs agents in rollout directories."""
    key = ALIASES.get(name, name)
    return key in ("command", "mini-swe-agent") or (key == "python" and options.get("isolation") == "process")


def load_adapter(
    spec: str | Mapping[str, Any],
    *,
    workdir_root: Path | None = None,
    process_defaults: Mapping[str, Any] | None = None,
    **options: Any,
) -> HarnessAdapter:
    """Build an adapter from a name or dotted path and options, or from one table.

    ``workdir_root`` is the default place for rollout directories (the appliance passes its
    data directory's ``rollouts/``), and ``process_defaults`` more defaults of the same kind
    (the appliance's sandbox and its limits); they go only to adapters that make rollout
    directories, and an option the spec gives wins.
    """
    if isinstance(spec, Mapping):
        table = dict(spec)
        name = table.pop("adapter", None) or table.pop("name", None)
        if not isinstance(name, str):
            raise ConfigError("an adapter table needs 'adapter = \"<name>\"'")
        options = table | options
    else:
        name = spec
    if makes_rollout_dirs(name, options):
        if workdir_root is not None:
            options.setdefault("workdir_root", workdir_root)
        for key, value in (process_defaults or {}).items():
            options.setdefault(key, value)
    factory = load_object(adapter_target(name), what="adapter")
    try:
        adapter = factory(**options)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or '(options)'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(f"adapter {name!r}: {problems}") from None
    except TypeError as exc:
        raise ConfigError(f"adapter {name!r}: {exc}") from None
    if not isinstance(adapter, HarnessAdapter):
        raise ConfigError(f"{name!r} did not build a HarnessAdapter (it has no 'name' and 'run')")
    return adapter
