"""Every place that counts failures says why, in the same words (``store.outcomes``): ``status``
(with ``--failures N`` listing the last N), the headless step line of ``up``, and ``eval``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appliance.app import Appliance
from appliance.cli import main
from appliance.cli.evaluate import _eval
from appliance.cli.up import progress_line
from appliance.config import ApplianceConfig
from appliance.rollouts.evaluation import evaluation_tasks
from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import PythonAdapter
from store.events import (
    ApplianceStarted,
    Event,
    RewardReported,
    RolloutCreated,
    RolloutFinished,
    TrainStepCompleted,
)
from store.projections import RunState
from tests.support import make_config
from tests.tui.run_events import write_run

TRACEBACK = "AgentFailed: agent exit code 1:\nTraceback (most recent call last):\nValueError: boom"


def failed_run() -> list[Event]:
    """Five rollouts timed out, one agent raised (a multi-line reason), one finished; a step
    consumed the first group of four (three timed out)."""
    events: list[Event] = [
        ApplianceStarted(
            ts=1.0, run_id="run-f", model="tiny", engine="torch", resumed_from_version=0, resumed_from_step=0
        )
    ]
    errors = ["timed out after 120 s"] * 3 + [""] + ["timed out after 120 s"] * 2 + [TRACEBACK]
    for i, error in enumerate(errors):
        rollout = f"r{i}"
        events.append(
            RolloutCreated(
                ts=2.0 + i,
                rollout=rollout,
                task_id=f"add-{i}",
                group=f"g{i // 4}",
                task={},
                policy_version=0,
                adapter="python",
            )
        )
        if error:
            events.append(RolloutFinished(ts=2.5 + i, rollout=rollout, status="failed", error=error))
        else:
            events.append(RewardReported(ts=2.4 + i, rollout=rollout, reward=1.0, source="agent"))
            events.append(RolloutFinished(ts=2.5 + i, rollout=rollout, status="finished"))
    events.append(
        TrainStepCompleted(
            ts=20.0, step=1, rollouts=("r0", "r1", "r2", "r3"), samples=1, tokens=3, zero_variance_groups=0
        )
    )
    return events


async def test_status_says_why_rollouts_failed_and_lists_the_last_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await write_run(tmp_path / "events.sqlite", failed_run())
    assert main(["status", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  failed 6: timed out after 120 s x5; AgentFailed: agent exit code 1:" in out
    assert "ValueError: boom x1" in out
    assert "failed rollouts" not in out  # listed only when asked

    assert main(["status", "--data-dir", str(tmp_path), "--failures", "2"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("last 2 failed rollouts") :].splitlines()[1:]
    assert listed[0] == "  r5  task add-5  timed out after 120 s"
    assert listed[1].startswith("  r6  task add-6  AgentFailed: agent exit code 1:")
    assert listed[1].endswith("ValueError: boom")

    assert main(["status", "--data-dir", str(tmp_path), "--failures", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failure_reasons"][0] == {"reason": "timed out after 120 s", "count": 5}
    assert [f["rollout"] for f in report["failures"]] == ["r0", "r1", "r2", "r4", "r5", "r6"]  # default 10
    assert report["failures"][0] == {
        "rollout": "r0",
        "task_id": "add-0",
        "purpose": "train",
        "reason": "timed out after 120 s",
    }


def test_the_headless_step_line_says_why_the_steps_rollouts_failed() -> None:
    state = RunState.from_events(failed_run())
    line = progress_line(state.steps[0], state, 0.0, 0)
    assert line.endswith("  failed 3: timed out after 120 s x3")


def failing_agent() -> PythonAdapter:
    """Raises for every task whose operand ``a`` is odd; answers the others without a model call
    (which the controller fails too: nothing to train on)."""

    async def agent(task: Task, client: ClientConfig) -> float:
        if task.data["a"] % 2:
            raise ValueError("odd operand")
        return 1.0

    return PythonAdapter(agent)


async def test_eval_says_why_its_rollouts_failed(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(tmp_path, tiny_model_dir, validation_tasks=6)

    class WithAgent(Appliance):
        def __init__(self, config: ApplianceConfig, **options: Any) -> None:
            super().__init__(config, adapter=failing_agent(), **options)

    monkeypatch.setattr("appliance.app.Appliance", WithAgent)
    # No rollout finished: no reward is reported (a mean of 0 would read as one) and it exits 1.
    assert await _eval(config, "validation", 1, as_json=False) == 1
    out = capsys.readouterr()
    assert "a validation round's tasks (the first validation_tasks = 6 held out" in out.err
    line = out.out.strip().splitlines()[-1]
    assert line.startswith("eval validation: 6 tasks x 1 = 6 rollouts")
    tasks = evaluation_tasks(config, "validation")
    odd = sum(task.data["a"] % 2 for task in tasks)
    assert 0 < odd < 6
    assert "reward" not in line
    failed = line[line.index("no rollout finished") :]
    # Two reasons, each once with its count: the agent's error, and the call it did not make.
    assert failed.startswith("no rollout finished: 6 failed: ") and failed.count(" x") == 2, failed
    assert f"odd operand x{odd}" in failed and f"x{6 - odd}" in failed
