"""Coding tasks (SWE-smith style) and their reward: the task's tests, run after the agent.

Owns the schema of a coding task and ``TaskTests``, the reward source that runs its tests. A
coding task is a task whose data holds (SWE-smith / SWE-bench field names where they exist):

=================== ==========================================================================
``instance_id``     the task id
``repo``            a directory, or a .tar/.tar.gz/.zip archive, holding the repository as the
                    agent starts from it (a path relative to the task set file is fine)
``problem_statement`` the issue the agent is given
``test_cmd``        a shell command, run in the working copy after the agent; exit code 0 means
                    solved (reward 1.0), anything else 0.0. Default: pytest on ``FAIL_TO_PASS``
                    and ``PASS_TO_PASS``
``FAIL_TO_PASS``    test ids that fail before the fix and pass after (optional)
``PASS_TO_PASS``    test ids that pass before and after (optional)
``test_files``      files restored from the snapshot before the tests run, so an agent cannot
                    pass by editing the tests (optional; SWE-bench applies its ``test_patch``);
                    so are the files that configure the run (``CONFIG_FILES``: conftest.py,
                    pytest.ini, ...), whatever the task says
``gold_patch``      a reference fix as a unified diff, to check the task set (optional; named so
                    because SWE-smith's own ``patch`` field is the bug, not the fix)
``image_name``      a container image for the ``kubernetes`` adapter (optional)
=================== ==========================================================================

The test command comes from the task set, not from the model, so running it with ``sh -c`` is
running the task author's code; it gets the verifier environment (no model credentials).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.errors import ConfigError
from harness_adapters.base import AgentFailed, Task
from harness_adapters.rewards import VerifyContext
from harness_adapters.workdir import copy_snapshot

#: Files that configure the interpreter or the test run wherever they are: an agent's own
#: version of one never reaches the tests (restored from the snapshot, or removed).
CONFIG_FILES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
    }
)


def _strings(value: Any, name: str, task_id: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # SWE-bench stores these lists as JSON strings
        try:
            value = json.loads(value)
        except ValueError:
            value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"task {task_id!r}: {name} must be a list of strings")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class CodingTask:
    instance_id: str
    repo: Path
    problem_statement: str
    test_cmd: str
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()
    gold_patch: str | None = None
    image_name: str | None = None

    @classmethod
    def from_task(cls, task: Task) -> CodingTask:
        data = task.data
        missing = [name for name in ("repo", "problem_statement") if not data.get(name)]
        if missing:
            raise ConfigError(f"task {task.id!r} is not a coding task: it has no {' or '.join(missing)}")
        f2p = _strings(data.get("FAIL_TO_PASS"), "FAIL_TO_PASS", task.id)
        p2p = _strings(data.get("PASS_TO_PASS"), "PASS_TO_PASS", task.id)
        test_cmd = data.get("test_cmd") or default_test_cmd(f2p + p2p)
        if not test_cmd:
            raise ConfigError(f"task {task.id!r} has neither test_cmd nor FAIL_TO_PASS/PASS_TO_PASS")
        return cls(
            instance_id=str(data.get("instance_id", task.id)),
            repo=Path(str(data["repo"])),
            problem_statement=str(data["problem_statement"]),
            test_cmd=str(test_cmd),
            fail_to_pass=f2p,
            pass_to_pass=p2p,
            test_files=_strings(data.get("test_files"), "test_files", task.id),
            gold_patch=data.get("gold_patch") or None,
            image_name=data.get("image_name") or None,
        )


def default_test_cmd(test_ids: tuple[str, ...]) -> str:
    if not test_ids:
        return ""
    return "python -m pytest -q -p no:cacheprovider " + " ".join(shlex.quote(t) for t in test_ids)


def config_files(root: Path) -> list[str]:
    """Paths under ``root`` (relative, ``.git`` left out) of the files ``CONFIG_FILES`` names."""
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            if name in CONFIG_FILES or name.endswith(".pth"):
                found.append(str((Path(directory) / name).relative_to(root)))
    return found


def restore_files(snapshot: Path, work: Path, names: tuple[str, ...]) -> None:
    """Put ``names`` back as they are in the snapshot, and every file that configures the test
    run (``CONFIG_FILES``: the snapshot's version, or none) (blocking; run in a thread)."""
    with tempfile.TemporaryDirectory() as scratch:
        pristine = Path(scratch) / "repo"
        copy_snapshot(snapshot, pristine)
        configs = sorted(set(config_files(work)) | set(config_files(pristine)))
        for name in (*names, *configs):
            source, dest = pristine / name, work / name
            if not source.resolve().is_relative_to(pristine.resolve()):
                raise ConfigError(f"test file {name!r} lies outside the repository")
            # The agent made the working copy: a directory on the way may be a link out of it.
            if not dest.parent.resolve().is_relative_to(work.resolve()):
                raise AgentFailed(f"the agent replaced a directory of test file {name!r} with a link")
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            else:
                dest.unlink(missing_ok=True)
            if source.is_dir():
                shutil.copytree(source, dest, symlinks=True)
            elif source.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest)


@dataclass(frozen=True, slots=True)
class TaskTests:
    """Reward source: 1.0 if the task's tests pass in the agent's working copy, else 0.0."""

    timeout_s: float = 300.0
    restore_test_files: bool = True

    async def reward(self, task: Task, ctx: VerifyContext) -> float:
        coding = CodingTask.from_task(task)
        if self.restore_test_files:
            await asyncio.to_thread(restore_files, coding.repo, ctx.rdir.work, coding.test_files)
        result = await ctx.run("tests", ["sh", "-c", coding.test_cmd], timeout_s=self.timeout_s)
        return 1.0 if result.returncode == 0 and not result.timed_out else 0.0
