"""``lightning-appliance eval``: every task of a split, k times, on the current policy, no training."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.app import Appliance
from appliance.cli.entry import _parser
from appliance.cli.up import _config_from
from appliance.config import ApplianceConfig, load_config
from appliance.rollouts.evaluation import evaluation_tasks
from appliance.rollouts.validation import validation_tasks
from contracts.errors import ConfigError
from store.events import EvaluationCompleted, RolloutCreated, RolloutFinished, TrainStepCompleted
from store.eventstore import read_events_sync
from tests.support import make_config

TASKS = [
    {"id": f"q{i}", "question": f"What is {i} + 1?", "answer": i + 1, "split": split}
    for i, split in enumerate(["train"] * 5 + ["validation"] * 3)
]


@pytest.fixture
def taskset(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in TASKS))
    return path


def test_the_splits_of_a_task_set_and_of_the_builtin_tasks(tmp_path: Path, taskset: Path) -> None:
    config = load_config(overrides={"data_dir": tmp_path, "tasks": taskset}, env={})
    assert sorted(t.id for t in evaluation_tasks(config, "validation")) == ["q5", "q6", "q7"]
    assert len(evaluation_tasks(config, "train")) == 5
    builtin = load_config(overrides={"data_dir": tmp_path}, env={})
    held, trained = evaluation_tasks(builtin, "validation", every=True), evaluation_tasks(builtin, "train")
    pairs = {(t.data["a"], t.data["b"]) for t in held}
    assert len(held) + len(trained) == 100
    assert pairs.isdisjoint({(t.data["a"], t.data["b"]) for t in trained})
    with pytest.raises(ConfigError, match="split must be one of"):
        evaluation_tasks(config, "test")


@pytest.mark.parametrize("validate_every", [5, 0])
def test_eval_plays_the_tasks_of_a_validation_round_unless_asked_for_every_one(
    tmp_path: Path, taskset: Path, validate_every: int
) -> None:
    """One definition: ``eval`` on the validation split plays what a round of ``up`` plays (the
    first ``validation_tasks`` held out), whether or not the run validates; ``--all`` every one."""
    builtin = load_config(overrides={"data_dir": tmp_path, "validate_every": validate_every}, env={})
    held_out = evaluation_tasks(builtin, "validation", every=True)
    assert len(held_out) > builtin.scheduler.validation_tasks == 8
    on = load_config(overrides={"data_dir": tmp_path}, env={})
    assert evaluation_tasks(builtin, "validation") == validation_tasks(on) == held_out[:8]
    two = load_config(overrides={"data_dir": tmp_path, "tasks": taskset, "validation_tasks": 2}, env={})
    assert [t.id for t in evaluation_tasks(two, "validation")] == [t.id for t in validation_tasks(two)]
    assert len(evaluation_tasks(two, "validation")) == 2
    assert len(evaluation_tasks(two, "validation", every=True)) == 3
    args = _parser().parse_args(["eval", "--all"])
    assert args.every and not _parser().parse_args(["eval"]).every


async def test_evaluate_runs_each_task_k_times_and_trains_nothing(
    tmp_path: Path, tiny_model_dir: Path, taskset: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, tasks=taskset)
    async with Appliance(config) as app:
        tasks = evaluation_tasks(config, "validation")
        result = await app.evaluate(tasks, split="validation", repeat=2)
        state = app.live.state
        views = [state.rollouts[r] for r in result.rollouts]
    events = [s.event for s in read_events_sync(config.db_path)]
    created = [e for e in events if isinstance(e, RolloutCreated)]
    assert sorted(e.task_id for e in created) == sorted(["q5", "q6", "q7"] * 2)
    assert {e.purpose for e in created} == {"evaluation"}
    assert len([e for e in events if isinstance(e, RolloutFinished)]) == 6
    assert not [e for e in events if isinstance(e, TrainStepCompleted)]
    (recorded,) = [e for e in events if isinstance(e, EvaluationCompleted)]
    assert recorded == result
    assert (result.split, result.repeat, result.policy_version, result.step) == ("validation", 2, 0, 0)
    rewards = [float(v.reward) for v in views if v.status == "finished" and v.reward is not None]
    assert result.failed == 6 - len(rewards)
    assert result.reward_mean == pytest.approx(statistics.fmean(rewards) if rewards else 0.0)


def test_the_eval_command_prints_and_records_the_result(
    tmp_path: Path, tiny_model_dir: Path, taskset: Path
) -> None:
    data = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "appliance.cli",
        "eval",
        "--model",
        str(tiny_model_dir),
        "--data-dir",
        str(data),
        "--port",
        "0",
        "--tasks",
        str(taskset),
        "--agent",
        "harness_adapters.examples.arithmetic:agent",
        "--split",
        "train",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert (printed["split"], printed["repeat"], printed["rollouts"]) == ("train", 1, 5)
    (recorded,) = [
        s.event for s in read_events_sync(data / "events.sqlite") if isinstance(s.event, EvaluationCompleted)
    ]
    assert printed["reward_mean"] == pytest.approx(recorded.reward_mean)
    status = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "status", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "eval train at step    0  policy v0  rollouts   5 (1x)" in status.stdout
    bad = subprocess.run(
        [*command[:-3], "--split", "test"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2 and "split must be one of" in bad.stderr


def test_up_takes_the_harness_from_flags(tmp_path: Path, taskset: Path) -> None:
    def config(*flags: str) -> ApplianceConfig:
        return _config_from(_parser().parse_args(["up", "--data-dir", str(tmp_path), *flags]))

    table = config(
        "--adapter", '{"adapter": "command", "command": "my-agent {question}"}', "--tasks", str(taskset)
    )
    assert table.harness.adapter == {"adapter": "command", "command": "my-agent {question}"}
    assert table.harness.tasks == taskset
    assert config("--adapter", "external").harness.adapter == {"adapter": "external"}
    with pytest.raises(ConfigError, match="--adapter is neither"):
        config("--adapter", "{not json")
