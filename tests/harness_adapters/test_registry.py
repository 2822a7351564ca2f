"""Adapters by name, dotted path or table; readable errors for the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contracts.errors import ConfigError
from harness_adapters.base import ClientConfig, HarnessAdapter, Task
from harness_adapters.command import CommandAdapter
from harness_adapters.mini_swe import MiniSweAgentAdapter
from harness_adapters.python import PythonAdapter
from harness_adapters.registry import ADAPTERS, load_adapter


class EchoAdapter:
    """A user's own adapter, found by dotted path."""

    name = "echo"

    def __init__(self, reward: float = 1.0) -> None:
        self.reward = reward

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        return self.reward


def test_by_name() -> None:
    command = load_adapter("command", command="my-agent {task_id}", max_concurrency=4)
    assert isinstance(command, CommandAdapter) and command.config.max_concurrency == 4
    python = load_adapter("python", agent="harness_adapters.examples.arithmetic:agent")
    assert isinstance(python, PythonAdapter) and python.name == "python"
    mini = load_adapter({"adapter": "mini-swe-agent", "step_limit": 5})
    assert isinstance(mini, MiniSweAgentAdapter) and mini.name == "mini-swe-agent"
    assert isinstance(load_adapter("mini", step_limit=5), MiniSweAgentAdapter)


def test_kubernetes_by_name() -> None:
    pytest.importorskip("kubernetes")
    adapter = load_adapter("k8s", command="agent", image="agents:1")
    assert adapter.name == "kubernetes"


def test_by_dotted_path() -> None:
    adapter = load_adapter({"adapter": "tests.harness_adapters.test_registry:EchoAdapter", "reward": 0.5})
    assert isinstance(adapter, EchoAdapter) and adapter.reward == 0.5
    assert isinstance(adapter, HarnessAdapter)


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        (
            "commnad",
            {},
            "unknown adapter 'commnad'; valid names: command, external, kubernetes, mini-swe-agent, python",
        ),
        ("command", {"comand": "x"}, "adapter 'command': command: Field required; comand: Extra inputs"),
        ("command", {"command": "x", "max_concurrency": 0}, "max_concurrency: Input should be greater"),
        ({"command": "x"}, {}, "needs 'adapter"),
        ("tests.harness_adapters.test_registry:Nope", {}, "no callable 'Nope'"),
        ("harness_adapters.tasks:arithmetic_task", {"index": 1}, "did not build a HarnessAdapter"),
        ("python", {"agent": "x:y"}, "cannot import agent module 'x'"),
        ("python", {"agent": "harness_adapters.examples.arithmetic:agent", "memory_mb": 1}, "need isolation"),
    ],
)
def test_errors_are_readable(spec: str | dict[str, Any], options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_adapter(spec, **options)


def test_default_workdir_root_goes_only_where_it_is_used(tmp_path: Path) -> None:
    command = load_adapter("command", command="x", workdir_root=tmp_path)
    assert isinstance(command, CommandAdapter) and command.config.workdir_root == tmp_path
    own = load_adapter(
        {"adapter": "command", "command": "x", "workdir_root": "/elsewhere"}, workdir_root=tmp_path
    )
    assert isinstance(own, CommandAdapter) and own.config.workdir_root == Path("/elsewhere")
    agent = "harness_adapters.examples.arithmetic:agent"
    assert isinstance(load_adapter("python", agent=agent, workdir_root=tmp_path), PythonAdapter)
    isolated = load_adapter("python", agent=agent, isolation="process", workdir_root=tmp_path)
    assert isinstance(isolated, PythonAdapter) and isolated.isolation == "process"


def test_every_registered_name_loads() -> None:
    assert set(ADAPTERS) == {"command", "python", "mini-swe-agent", "kubernetes", "external"}
