"""The ``python`` adapter: loading agents, in-process failures, process isolation; the task stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.errors import ConfigError
from harness_adapters.base import AgentFailed, ClientConfig, Task
from harness_adapters.examples.arithmetic import run_tool, score
from harness_adapters.python import PythonAdapter, load_agent
from harness_adapters.tasks import arithmetic_task, arithmetic_tasks
from tests.harness_adapters.support import client_config

PY_AGENT = "tests.harness_adapters.agents.py_agents:agent"


def test_load_agent_resolves_a_dotted_path() -> None:
    agent = load_agent("harness_adapters.examples.arithmetic:agent")
    assert agent.__name__ == "agent"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon", "package.module:function"),
        ("no_such_module_here:agent", "cannot import"),
        ("harness_adapters.examples.arithmetic:missing", "no callable"),
    ],
)
def test_load_agent_errors_are_readable(target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_agent(target)


async def test_python_adapter_returns_the_agent_reward() -> None:
    seen: list[str] = []

    async def agent(task: Task, client: ClientConfig) -> float:
        seen.append(f"{task.id}@{client.base_url}")
        return 0.5

    client = ClientConfig(
        rollout_id="r", base_url="http://x/v1", api_key="k", reward_url="http://x/reward", model="m"
    )
    assert await PythonAdapter(agent).run(Task(id="t"), client) == 0.5
    assert seen == ["t@http://x/v1"]


def test_task_stream_is_deterministic_and_resumable() -> None:
    stream = arithmetic_tasks(seed=3)
    first = [next(stream) for _ in range(5)]
    assert first == [arithmetic_task(i, seed=3) for i in range(5)]
    resumed = arithmetic_tasks(seed=3, start=2)
    assert next(resumed) == first[2]
    task = first[0]
    assert task.data["answer"] == task.data["a"] + task.data["b"]
    assert task.data["question"] == f"What is {task.data['a']} + {task.data['b']}?"


@pytest.mark.parametrize(
    ("reply", "reward"), [("7", 1.0), ("The answer is 7.", 1.0), ("8", 0.25), ("seven", 0.0), ("", 0.0)]
)
def test_score(reply: str, reward: float) -> None:
    assert score(reply, 7) == reward


def test_run_tool() -> None:
    assert run_tool('{"a": 2, "b": 5}') == "7"
    assert run_tool("not json").startswith("error:")


async def test_an_exception_becomes_agent_failed_with_its_traceback() -> None:
    async def agent(task: Task, client: ClientConfig) -> float:
        raise KeyError("answer")

    with pytest.raises(AgentFailed) as caught:
        await PythonAdapter(agent).run(Task(id="t"), client_config())
    assert str(caught.value).startswith("KeyError: 'answer'\nTraceback")
    assert isinstance(caught.value.__cause__, KeyError)


async def test_process_isolation_runs_the_agent_in_a_worker(tmp_path: Path) -> None:
    adapter = PythonAdapter(PY_AGENT, isolation="process", workdir_root=tmp_path)
    with pytest.raises(AgentFailed, match="exit code 1") as caught:
        await adapter.run(Task("t", {"behavior": "crash"}), client_config())
    assert str(caught.value).endswith("RuntimeError: boom-crash-marker")


def test_process_isolation_needs_a_dotted_path() -> None:
    async def agent(task: Task, client: ClientConfig) -> None:
        return None

    with pytest.raises(ConfigError, match="needs the agent as"):
        PythonAdapter(agent, isolation="process")
    with pytest.raises(ConfigError, match="isolation must be"):
        PythonAdapter(PY_AGENT, isolation="thread")  # type: ignore[arg-type]


async def test_process_isolation_runs_in_the_sandbox_with_the_agents_code(tmp_path: Path) -> None:
    from harness_adapters.python import agent_code
    from harness_adapters.sandbox import bwrap_problem

    assert agent_code(PY_AGENT) == Path(__file__).parents[1]  # the tests package, nothing more
    assert agent_code("harness_adapters.examples.retry_arithmetic:agent") is None  # seen already
    if bwrap_problem() is not None:
        pytest.skip(f"no bubblewrap: {bwrap_problem()}")
    adapter = PythonAdapter(PY_AGENT, isolation="process", workdir_root=tmp_path, sandbox="bwrap")
    with pytest.raises(AgentFailed, match="exit code 1") as caught:
        await adapter.run(Task("t", {"behavior": "crash"}), client_config(port=18641))
    assert str(caught.value).endswith("RuntimeError: boom-crash-marker")
