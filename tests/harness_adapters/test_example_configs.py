"""The example configs (``harness_adapters/examples/configs/``): each loads, and each harness runs.

Every config is loaded with ``load_config`` (so it validates), its adapter is built with
``load_adapter`` and its command rendered for a task of its task set. For each harness that is
installed here, ONE rollout runs end to end: a real appliance on the tiny model with the
example's harness settings (adapter, task set) starts a group of one through its controller;
the real harness runs as the config says, and the rollout must finish (not fail), get a reward
from the config's verifier or reward function, and have its model calls recorded under the
harness's own API surface and User-Agent. The tiny random model answers nonsense (so the
rewards are 0.0 but for a fluke); what is tested is that the config runs the harness against
the appliance and judges its work.

The helpers of the examples (``answers``, ``task_tests``, ``aider_agent``) are tested here
too, since the harnesses that use them are not all installed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.app import Appliance
from appliance.config import ApplianceConfig, load_config
from harness_adapters.base import Task
from harness_adapters.command import CommandAdapter
from harness_adapters.examples.agents import calculator
from harness_adapters.examples.agents.aider_agent import source_files
from harness_adapters.examples.agents.answers import answer_reward
from harness_adapters.mini_swe import MiniSweAgentAdapter
from harness_adapters.registry import load_adapter
from harness_adapters.sandbox import bwrap_problem
from harness_adapters.tasks import TaskSet
from harness_adapters.workdir import RolloutDir
from store.events import LLMCallCompleted
from tests.harness_adapters.support import PYTHON_BUGS, client_config, wait_ended
from tests.support import make_config

ROOT = Path(__file__).parents[2]
CONFIGS = ROOT / "harness_adapters" / "examples" / "configs"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Example:
    """One example config and what its harness looks like from the proxy."""

    config: str
    #: A module the harness needs (None: ``executable`` instead).
    module: str | None
    #: The API surface its calls are recorded under, and a part of its User-Agent.
    surface: str
    user_agent: str
    #: The default completion length for the test (mini-swe-agent asks for none; 32 tokens of
    #: nonsense are a format error, which ends its run after three).
    max_tokens: int = 16
    #: An executable the harness needs (looked up next to this Python, then on PATH).
    executable: str | None = None
    #: Why the harness cannot run on the tiny model even when installed (None: it can).
    not_on_tiny: str | None = None

    def missing(self) -> str | None:
        """Why this harness cannot run here, or None."""
        if self.not_on_tiny is not None:
            return self.not_on_tiny
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return f"{self.module!r} is not installed"
        if self.executable is not None and find_executable(self.executable) is None:
            return f"{self.executable!r} is not on PATH"
        return None


def find_executable(name: str) -> str | None:
    local = BIN / name
    return str(local) if local.is_file() else shutil.which(name)


EXAMPLES = [
    Example("openai_sdk.toml", "openai", "openai.chat", "OpenAI/Python"),
    Example("openai_agents.toml", "agents", "openai.responses", "Agents/Python"),
    Example("litellm.toml", "litellm", "openai.chat", "OpenAI/Python"),
    Example("mini_swe_agent.toml", "minisweagent", "openai.chat", "OpenAI/Python", 32, "mini"),
    Example("langgraph.toml", "langgraph", "openai.chat", "OpenAI/Python"),
    Example(
        "smolagents.toml",
        "smolagents",
        "openai.chat",
        "OpenAI/Python",
        not_on_tiny="smolagents' CodeAgent system prompt is ~4,500 tokens of the tiny model's tokenizer, "
        "over its 2,048-token context (the proxy answers 400)",
    ),
    Example("anthropic_sdk.toml", "anthropic", "anthropic.messages", "Anthropic/Python"),
    Example("aider.toml", None, "openai.chat", "OpenAI/Python", executable="aider"),
]


def example_config(example: Example) -> ApplianceConfig:
    return load_config(CONFIGS / example.config, env={})


def tasks_of(config: ApplianceConfig) -> TaskSet:
    """The config's training tasks (its paths are relative to the repository root)."""
    assert config.harness.tasks is not None, "an example config names its task set"
    return TaskSet.load(ROOT / config.harness.tasks, split=config.harness.task_split)


def test_every_config_is_covered() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.toml")) == sorted(e.config for e in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.config for e in EXAMPLES])
def test_the_config_loads_and_runs_each_task_once(example: Example, tmp_path: Path) -> None:
    config = example_config(example)
    tasks = tasks_of(config)
    scheduler = config.scheduler
    assert (scheduler.group_size, scheduler.batch_groups) == (1, len(tasks)), "each task once"
    assert (scheduler.max_steps, scheduler.validate_every) == (1, 0)
    # Agents mostly send no limit: the default length must leave room for a step or a tool call.
    max_tokens = config.proxy.max_tokens
    assert max_tokens is not None and 512 <= max_tokens <= config.proxy.max_tokens_cap

    adapter = load_adapter(config.harness.adapter_spec(), workdir_root=tmp_path)
    assert isinstance(adapter, CommandAdapter | MiniSweAgentAdapter)
    command = adapter if isinstance(adapter, CommandAdapter) else adapter.command
    # Every placeholder of the command is a field of every task (or a built-in).
    for task in tasks:
        argv = command.agent_argv(task, client_config(), RolloutDir(tmp_path / task.id))
        assert not [arg for arg in argv if "{" in arg and "}" in arg], argv
    if isinstance(adapter, CommandAdapter):
        assert argv[:2] == ["python", "-m"], "agents run on the appliance's Python (python_on_path)"
        assert importlib.util.find_spec(argv[2]) is not None, f"{argv[2]} is not in the repository"
        assert command.reward_sources[0].__class__.__name__ in ("VerifierCommand", "RewardFunction")


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.config for e in EXAMPLES])
async def test_one_rollout_of_the_harness(example: Example, tmp_path: Path, tiny_model_dir: Path) -> None:
    reason = example.missing()
    if reason is not None:
        pytest.skip(f"{example.config}: {reason} (see the README's Example configs)")
    harness = example_config(example).harness
    assert harness.adapter is not None and harness.tasks is not None
    config = make_config(
        tmp_path,
        tiny_model_dir,
        adapter=harness.adapter,
        tasks=ROOT / harness.tasks,
        task_split=harness.task_split,
        group_size=1,
        max_tokens=example.max_tokens,
        max_tokens_cap=example.max_tokens,
        rollout_timeout_s=90.0,
    )
    async with Appliance(config) as app:
        # The default sandbox ("auto"): each harness runs in bubblewrap, unchanged.
        assert app.isolation.kind == ("bwrap" if bwrap_problem() is None else "none"), app.isolation.line
        group = await app.controller.start_group(1)
        await wait_ended(app, 1, timeout_s=150)
        rollout = f"{group}-r0"
        view = app.live.state.rollouts[rollout]
        calls = [
            s.event for s in await app.store.read(rollout=rollout) if isinstance(s.event, LLMCallCompleted)
        ]

    assert view.status == "finished", view.error
    # The config's verifier or reward function judged the answer (None: nothing judged it).
    assert view.reward in (0.0, 1.0), view.reward
    assert calls, "no model call was recorded"
    assert {c.surface for c in calls} == {example.surface}
    assert all(example.user_agent in c.user_agent for c in calls), {c.user_agent for c in calls}


# --- the helpers the examples share ----------------------------------------------------------


def test_answer_reward_reads_the_last_number(tmp_path: Path) -> None:
    task = Task("t", {"question": "What is 8 + 9?", "answer": 17})
    assert answer_reward(task, tmp_path) == 0.0, "no answer.txt"
    (tmp_path / "answer.txt").write_text("8 + 9 = 17")
    assert answer_reward(task, tmp_path) == 1.0
    (tmp_path / "answer.txt").write_text("17, no: 18")
    assert answer_reward(task, tmp_path) == 0.0


def test_the_calculator_tool_and_answer_agree_with_the_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert calculator.add_reply({"a": 8, "b": 9.5}) == "17.5"
    assert calculator.add_reply({"a": 8}).startswith("error: ")
    assert calculator.add_reply("not a mapping").startswith("error: ")
    monkeypatch.chdir(tmp_path)
    calculator.write_answer("17")
    assert answer_reward(Task("t", {"answer": 17}), tmp_path) == 1.0


def test_aider_agent_gives_aider_the_sources_and_the_model_context(tmp_path: Path) -> None:
    fizzbuzz = next(t for t in TaskSet.load(PYTHON_BUGS) if "fizzbuzz" in t.id)
    repo = Path(str(fizzbuzz.data["repo"]))
    assert source_files(repo) == ["fizzbuzz.py"]
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "MODEL_CONTEXT_TOKENS": "2048"}
    out = subprocess.run(
        [sys.executable, "-m", "harness_adapters.examples.agents.aider_agent", "echo", "--model", "openai/m"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["--model", "openai/m", "fizzbuzz.py"]
    metadata = json.loads((tmp_path / ".aider.model.metadata.json").read_text())
    assert metadata["openai/m"]["max_input_tokens"] == 2048
    assert metadata["openai/m"]["litellm_provider"] == "openai"


def test_task_tests_restores_the_tests_then_runs_them(tmp_path: Path) -> None:
    fizzbuzz = next(t for t in TaskSet.load(PYTHON_BUGS) if "fizzbuzz" in t.id)
    work = tmp_path / "work"
    shutil.copytree(Path(str(fizzbuzz.data["repo"])), work)
    task_json = tmp_path / "task.json"
    task_json.write_text(json.dumps({"id": fizzbuzz.id, "data": fizzbuzz.data}))

    def verify() -> int:
        env = {"TASK_JSON": str(task_json), "PATH": f"{BIN}:/usr/bin:/bin"}
        cmd = [sys.executable, "-m", "harness_adapters.examples.agents.task_tests"]
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, check=False).returncode

    # An agent that "passes" by emptying the tests still fails: the tests are put back.
    (work / "test_fizzbuzz.py").write_text("def test_nothing():\n    pass\n")
    assert verify() != 0
    assert "test_first_five" in (work / "test_fizzbuzz.py").read_text()
    source = work / "fizzbuzz.py"
    source.write_text(source.read_text().replace("range(1, n)", "range(1, n + 1)"))
    assert verify() == 0
