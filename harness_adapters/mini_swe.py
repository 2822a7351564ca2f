"""The ``mini-swe-agent`` adapter: the ``mini`` CLI on a coding task, rewarded by its tests.

Owns how mini-swe-agent is run headless against one rollout: ``mini -m openai/<model> -t
<problem statement> -y --exit-immediately -o <rollout dir>/trajectory.json -c mini.yaml -c
mini_swe.yaml -c agent.step_limit=N -c environment.timeout=S`` in a fresh copy of the task's
repository, with the rollout's URL and key in ``OPENAI_*`` (litellm's ``openai/`` route reads
them) and the ``MSWEA_*`` variables that keep it from asking questions, looking up model costs,
retrying a failed call for minutes, or reading the user's own config. Everything else (the
rollout directory, scrubbed environment, limits, stopping the tree) is the ``command``
adapter's; the reward is ``CodingTests``: for a SWE-bench instance (checked out from its
mirror in ``repos_dir``) its FAIL_TO_PASS and PASS_TO_PASS tests on the agent's diff in a fresh
checkout (``SweBenchTests``), else the task's tests run after mini exits, with the test files
restored first (``TaskTests``; 1.0 if they pass, else 0.0).

mini-swe-agent exits 0 when its run ends normally (submitted, step limit, repeated format
errors), so an unsolved task is a finished rollout with reward 0.0 (a training signal), and
only a crash (nonzero exit, e.g. a model call that failed) is a failed rollout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from harness_adapters.base import ClientConfig, Task
from harness_adapters.coding import CodingTask
from harness_adapters.command import CommandAdapter, CommandConfig, ProcessOptions
from harness_adapters.swebench import CodingTests, is_swebench

CONFIG = Path(__file__).with_name("mini_swe.yaml")


def default_mini() -> str:
    return str(Path(sys.executable).parent / "mini")


def _literal(text: str) -> str:
    """``text`` as a template argument with no placeholders."""
    return text.replace("{", "{{").replace("}", "}}")


class MiniSweConfig(ProcessOptions):
    """The ``mini-swe-agent`` adapter's configuration."""

    mini: str = Field(default_factory=default_mini)
    """The ``mini`` executable (default: the one next to the appliance's Python)."""
    model_prefix: str = "openai/"
    """litellm route put before the served model's name."""
    config_files: list[str] = Field(default_factory=lambda: ["mini.yaml", str(CONFIG)])
    """mini-swe-agent config files, merged in order (``-c``)."""
    step_limit: int = 30
    """Most model calls per rollout (``agent.step_limit``)."""
    command_timeout_s: int = 60
    """Seconds one bash command of the agent may run (``environment.timeout``)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """More ``-c key=value`` settings, e.g. ``{"model.model_kwargs.temperature": 1.0}``."""
    model_retry_attempts: int = 1
    """Attempts per model call (``MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT``); 1 fails at once."""
    test_timeout_s: float = 300.0
    """Seconds the task's tests may run after the agent (past it, the reward is 0.0)."""
    restore_test_files: bool = True
    """Restore the task's ``test_files`` from the snapshot before running its tests."""
    scoring: Literal["binary", "fraction"] = "binary"
    """A SWE-bench instance's reward: 1.0 iff all its tests pass, or the share that pass."""


class MiniSweAgentAdapter:
    name = "mini-swe-agent"

    def __init__(self, config: MiniSweConfig | None = None, /, **options: Any) -> None:
        self.config = config if config is not None else MiniSweConfig(**options)
        c = self.config
        argv = [
            _literal(c.mini),
            "-m",
            _literal(c.model_prefix) + "{model}",
            "-t",
            "{problem_statement}",
            "-y",
            "--exit-immediately",
            "-o",
            "{rollout_dir}/trajectory.json",
        ]
        settings = [*c.config_files, f"agent.step_limit={c.step_limit}"]
        settings.append(f"environment.timeout={c.command_timeout_s}")
        settings += [f"{key}={json.dumps(value)}" for key, value in c.overrides.items()]
        for setting in settings:
            argv += ["-c", _literal(setting)]
        env = {
            # Headless: no first-run wizard, no cost lookups for an unknown model, no network.
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_CONFIG_DIR": "{rollout_dir}/mswea",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(c.model_retry_attempts),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "PAGER": "cat",
        } | c.env
        options = c.model_dump(include=set(ProcessOptions.model_fields)) | {"env": env}
        self.command = CommandAdapter(
            CommandConfig(command=argv, **options),
            reward_sources=[
                CodingTests(c.test_timeout_s, c.restore_test_files, scoring=c.scoring, repos_dir=c.repos_dir)
            ],
        )

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        if not is_swebench(task):
            CodingTask.from_task(task)  # a readable ConfigError for a task that is not a coding task
        return await self.command.run(task, client)
