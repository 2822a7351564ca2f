"""The ``python`` adapter: an async agent function, in this process or in a process of its own.

Owns loading ``module.path:function`` and calling it as
``await agent(task, client_config) -> reward | None``. The agent talks to the proxy over HTTP
like any other harness, so it goes through exactly the same path as an external process.

Two ways to run it (``isolation``):

* ``"none"`` (the default): the coroutine runs on the appliance's event loop. The controller's
  timeout cancels it; subprocesses it starts should go through ``harness_adapters.process``
  (``run_process``), which stops their whole tree when the coroutine is cancelled. An
  exception becomes ``AgentFailed`` with the traceback's tail.
* ``"process"``: the function runs in ``python -m harness_adapters.python_worker`` under the
  ``command`` adapter, with everything that adapter gives: its own rollout directory,
  scrubbed environment, resource limits, a process tree stopped on timeout, a crash (even of
  the interpreter) recorded with its stderr tail, and the appliance's sandbox (``[harness]
  sandbox``: the agent's own code is made readable in it, ``agent_code``). Blocking code
  cannot stall the appliance. The module must be importable in the child (the appliance's
  working directory is on its ``PYTHONPATH``).

``"none"`` cannot be sandboxed: the agent is code in the appliance's own process, which can
read what the appliance can (its admin token, its log). Agents whose model output runs as
commands or code belong in ``"process"`` (or the ``command`` adapter); the appliance says at
start, in ``status`` and in ``doctor`` that agents run unsandboxed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from contracts.errors import ConfigError
from harness_adapters.base import DETAIL_CHARS, AgentFailed, ClientConfig, InfraError, Task
from harness_adapters.lifecycle import Slots
from harness_adapters.loading import load_object

AgentFn = Callable[[Task, ClientConfig], Awaitable[float | None]]
Isolation = Literal["none", "process"]


def load_agent(target: str) -> AgentFn:
    """Import ``package.module:function``; a readable ConfigError if it is not there."""
    agent: AgentFn = load_object(target, what="agent")
    return agent


def agent_code(target: str) -> Path | None:
    """Where the code of ``package.module:function`` lives: its top-level package's directory
    (or module file); None for code in the project's own packages or an installed one, which a
    sandbox sees already."""
    top = target.split(":", 1)[0].split(".", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    where = origin.parent if spec.submodule_search_locations else origin
    installed = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix)]
    if top in ("harness_adapters", "contracts") or any(where.is_relative_to(p) for p in installed):
        return None
    return where


class PythonAdapter:
    name = "python"

    def __init__(
        self,
        agent: AgentFn | str,
        *,
        isolation: Isolation = "none",
        max_concurrency: int | None = None,
        **process_options: Any,
    ) -> None:
        if isolation not in ("none", "process"):
            raise ConfigError(f"isolation must be 'none' or 'process'; got {isolation!r}")
        self.isolation = isolation
        self._slots = Slots(max_concurrency)
        if isolation == "process":
            if not isinstance(agent, str):
                raise ConfigError("isolation='process' needs the agent as 'package.module:function'")
            load_agent(agent)  # fail now, not in every rollout
            # Imported here, not at the top: the worker process imports this module, and the
            # command adapter's imports (pydantic among them) would slow every rollout's start.
            from harness_adapters.command import CommandAdapter

            path = [str(Path.cwd()), *filter(None, [os.environ.get("PYTHONPATH")])]
            env = {"PYTHONPATH": os.pathsep.join(path)}
            env |= process_options.pop("env", {})
            # In a sandbox, the agent's own code is the one thing of the host it must read.
            code = agent_code(agent)
            if code is not None:
                seen = list(process_options.get("read_only_paths", []))
                process_options["read_only_paths"] = [*seen, code]
            self._process: CommandAdapter | None = CommandAdapter(
                command=[sys.executable, "-m", "harness_adapters.python_worker", agent],
                env=env,
                **process_options,
            )
            self.agent: AgentFn | None = None
        else:
            if process_options:
                raise ConfigError(f"options {sorted(process_options)} need isolation='process'")
            self._process = None
            self.agent = load_agent(agent) if isinstance(agent, str) else agent

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        async with self._slots:
            return await self._run(task, client)

    async def _run(self, task: Task, client: ClientConfig) -> float | None:
        if self._process is not None:
            return await self._process.run(task, client)
        assert self.agent is not None
        try:
            return await self.agent(task, client)
        except (AgentFailed, InfraError, ConfigError):
            raise
        except Exception as exc:
            trace = "".join(traceback.format_exception(exc))
            raise AgentFailed(f"{type(exc).__name__}: {exc}", detail=trace[-DETAIL_CHARS:]) from exc
