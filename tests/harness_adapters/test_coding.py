"""The shipped coding task set: every task fails as shipped and is solved by its gold patch."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from harness_adapters.base import Task
from harness_adapters.coding import CodingTask, TaskTests, default_test_cmd
from harness_adapters.command import CommandAdapter
from harness_adapters.tasks import TaskSet, load_splits
from tests.harness_adapters.support import PYTHON_BUGS, client_config

APPLY_GOLD_PATCH = """sh -c 'printf "%s" "$TASK_GOLD_PATCH" | git apply -'"""


def graded_adapter(command: str | list[str], root: Path) -> CommandAdapter:
    return CommandAdapter(command=command, workdir_root=root, reward_sources=[TaskTests(timeout_s=120)])


def test_the_shipped_task_set_is_well_formed() -> None:
    splits = load_splits(PYTHON_BUGS)
    assert {name: len(s) for name, s in splits.items()} == {"train": 3, "validation": 1}
    for task in (*splits["train"], *splits["validation"]):
        coding = CodingTask.from_task(task)
        assert coding.instance_id == task.id
        assert coding.repo.is_dir() and coding.repo.is_absolute()
        assert coding.fail_to_pass and coding.gold_patch and coding.test_files
        assert all((coding.repo / name).is_file() for name in coding.test_files)


async def test_each_task_fails_as_shipped_and_passes_with_its_gold_patch(tmp_path: Path) -> None:
    tasks = list(TaskSet.load(PYTHON_BUGS, split=None))
    unsolved = graded_adapter("true", tmp_path)
    solved = graded_adapter(APPLY_GOLD_PATCH, tmp_path)
    before = await asyncio.gather(*(unsolved.run(t, client_config(f"{t.id}-a")) for t in tasks))
    after = await asyncio.gather(*(solved.run(t, client_config(f"{t.id}-b")) for t in tasks))
    assert before == [0.0] * len(tasks)
    assert after == [1.0] * len(tasks)


async def test_edited_tests_are_restored_before_they_run(tmp_path: Path) -> None:
    task = TaskSet.load(PYTHON_BUGS)[0]
    (test_file,) = CodingTask.from_task(task).test_files
    cheat = f"sh -c 'printf \"def test_nothing() -> None:\\n    pass\\n\" > {test_file}'"
    assert await graded_adapter(cheat, tmp_path).run(task, client_config()) == 0.0
    lenient = CommandAdapter(
        command=cheat, workdir_root=tmp_path, reward_sources=[TaskTests(restore_test_files=False)]
    )
    assert await lenient.run(task, client_config("r2")) == 1.0, "without the restore, the cheat works"


def test_coding_schema_errors_and_defaults() -> None:
    with pytest.raises(ConfigError, match="no repo or problem_statement"):
        CodingTask.from_task(Task("t", {}))
    with pytest.raises(ConfigError, match="neither test_cmd"):
        CodingTask.from_task(Task("t", {"repo": "/r", "problem_statement": "p"}))
    swe_bench_style = Task(
        "t",
        {"repo": "/r", "problem_statement": "p", "FAIL_TO_PASS": '["a.py::test_x"]', "PASS_TO_PASS": "[]"},
    )
    coding = CodingTask.from_task(swe_bench_style)
    assert coding.fail_to_pass == ("a.py::test_x",)
    assert coding.test_cmd == default_test_cmd(("a.py::test_x",))
    assert coding.test_cmd == "python -m pytest -q -p no:cacheprovider a.py::test_x"


async def test_a_conftest_the_agent_adds_never_reaches_the_tests(tmp_path: Path) -> None:
    task = TaskSet.load(PYTHON_BUGS)[0]
    # Every test reported as passed: a conftest.py hook that rewrites each report.
    hook = (
        "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n"
        "    outcome.get_result().outcome = 'passed'\n"
    )
    write = f"import pathlib; pathlib.Path('conftest.py').write_text({hook!r})"
    cheat = [sys.executable, "-c", write]
    assert await graded_adapter(cheat, tmp_path).run(task, client_config()) == 0.0
    lenient = CommandAdapter(
        command=cheat, workdir_root=tmp_path, reward_sources=[TaskTests(restore_test_files=False)]
    )
    assert await lenient.run(task, client_config("r2")) == 1.0, "without the restore, the cheat works"
