"""The ``python`` adapter: an async agent function in this process.

Owns loading ``module.path:function`` and calling it as
``await agent(task, client_config) -> reward | None``. The agent talks to the proxy over HTTP
like any other harness, so it goes through exactly the same path as an external process.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable

from appliance.errors import ConfigError
from harness_adapters.base import ClientConfig, Task

AgentFn = Callable[[Task, ClientConfig], Awaitable[float | None]]


def load_agent(target: str) -> AgentFn:
    """Import ``package.module:function``; a readable ConfigError if it is not there."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"agent must look like 'package.module:function'; got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import agent module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{module_name!r} has no callable {attr!r}")
    agent: AgentFn = fn
    return agent


class PythonAdapter:
    name = "python"

    def __init__(self, agent: AgentFn | str) -> None:
        self.agent = load_agent(agent) if isinstance(agent, str) else agent

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        return await self.agent(task, client)
