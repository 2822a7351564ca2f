"""Coding tasks as SWE-bench ships them: the instance schema, its checkout, and its verifier.

Owns ``SweBenchInstance`` (an instance in SWE-bench's own fields), ``prepare_workdir`` (a
rollout's working copy at ``base_commit``, from a local mirror), ``SweBenchTests`` (the reward:
the agent's changes, less the test files, plus ``test_patch``, tested in a fresh checkout) and
``CodingTests`` (the reward of any coding task: this one or ``coding.TaskTests``). The git
commands are ``gitrepos``'s; the old schema (``repo`` a directory or archive) is ``coding``'s.

================================ ===============================================================
``instance_id``                  the task id
``repo``                         ``owner/name``; its mirror is ``<repos_dir>/owner__name.git``
``base_commit``                  the commit the agent starts from
``problem_statement``            the issue the agent is given
``patch``                        the gold fix (SWE-bench's meaning; SWE-smith's ``patch`` is the
                                 bug, which is why an instance is told by ``base_commit`` and
                                 ``test_patch``, which SWE-smith tasks do not have)
``test_patch``                   the tests, applied after the agent, over whatever it did to them
``FAIL_TO_PASS``, ``PASS_TO_PASS`` test ids (lists, or JSON strings of lists as ``datasets``
                                 stores them); the reward counts exactly these
``test_cmd``                     (optional) a shell command printing pytest ``-rA`` lines;
                                 default ``python -m pytest -rA -p no:cacheprovider <files>``,
                                 the files holding those ids (as SWE-bench runs them: an id that
                                 no longer exists fails alone instead of stopping the run)
``repos_dir``                    (optional) the mirrors' directory, over the adapter's option
``version``, ``environment_setup_commit``, ``image_name``  (optional) kept, unused here
================================ ===============================================================

The verifier never trusts the agent's ``.git``: the agent's working tree is staged with the
fresh checkout's own git directory (``gitrepos``: no hooks, no fsmonitor, no external diff), on
the host, reading the tree only. From that patch it drops (listed in ``verify/dropped.txt``)
every test file (one the ``test_patch`` touches, or one a counted test id names); anything named
``conftest.py``, ``pytest.ini``, ``.pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``
(each can configure pytest: add a plugin, deselect tests), ``sitecustomize.py``,
``usercustomize.py`` or ``*.pth``; and, under the directory of a test file, every file when
that directory is a test directory (a ``test``/``tests``/``testing`` component, as SWE-bench
splits its patches), else the test-looking files (``test_*.py``, ``*_test.py``, ``tests.py``).
A fix that must change one of these fails ``lightning-appliance tasks check``. Code under test
still runs inside pytest's process and could subvert it; that is as true of SWE-bench's own
harness.

Reward ``binary``: 1.0 iff every ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` id PASSED (or XFAIL, as
SWE-bench counts it); ``fraction``: the share that did. An id missing from the output failed, as
did one with any FAILED or ERROR line. A patch that does not apply, a tree that cannot be read,
or tests past their timeout give 0.0 with the reason in ``verify/results.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from contracts.errors import ConfigError
from harness_adapters import gitrepos
from harness_adapters.base import Task
from harness_adapters.coding import CONFIG_FILES, TaskTests
from harness_adapters.rewards import VerifyContext
from harness_adapters.workdir import RolloutDir

Scoring = Literal["binary", "fraction"]
PASSING = frozenset({"PASSED", "XFAIL"})
FAILING = frozenset({"FAILED", "ERROR"})
STATUSES = PASSING | FAILING | {"XPASS", "SKIPPED"}
TEST_DIR_NAMES = frozenset({"test", "tests", "testing"})
TEST_FILE = re.compile(r"(test_.*|.*_test|tests)\.py\Z")


def _id_list(value: Any, name: str, task_id: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"task {task_id!r}: {name} must be a list of test ids")
    return tuple(value)


def _repo_name(value: Any) -> str | None:
    """``owner/name``; also from the absolute path a task set loader made of it (``tasks.py``
    resolves a relative ``repo`` against the task file's directory)."""
    if not isinstance(value, str):
        return None
    if gitrepos.OWNER_NAME.match(value) and ".." not in value:
        return value
    path = PurePosixPath(value)
    if path.is_absolute() and len(path.parts) > 2 and not Path(value).exists():
        tail = "/".join(path.parts[-2:])
        return tail if gitrepos.OWNER_NAME.match(tail) and ".." not in tail else None
    return None


def is_swebench(task: Task) -> bool:
    """Whether ``task`` is a SWE-bench instance: ``base_commit``, ``test_patch``, ``repo`` owner/name."""
    data = task.data
    return (
        isinstance(data.get("base_commit"), str)
        and bool(data["base_commit"])
        and isinstance(data.get("test_patch"), str)
        and bool(data["test_patch"])
        and _repo_name(data.get("repo")) is not None
    )


def _optional(data: dict[str, Any], name: str) -> str | None:
    value = data.get(name)
    return None if value is None or value == "" else str(value)


@dataclass(frozen=True, slots=True)
class SweBenchInstance:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    patch: str | None = None
    test_cmd: str | None = None
    version: str | None = None
    environment_setup_commit: str | None = None
    image_name: str | None = None
    repos_dir: Path | None = None

    @classmethod
    def from_task(cls, task: Task) -> SweBenchInstance:
        data = task.data
        if not is_swebench(task):
            raise ConfigError(
                f"task {task.id!r} is not a SWE-bench instance: it needs repo (owner/name), "
                "base_commit and test_patch"
            )
        base_commit = str(data["base_commit"])
        if not gitrepos.COMMIT.match(base_commit):
            raise ConfigError(f"task {task.id!r}: base_commit {base_commit!r} is not a commit id")
        if not data.get("problem_statement"):
            raise ConfigError(f"task {task.id!r} has no problem_statement")
        f2p = _id_list(data.get("FAIL_TO_PASS"), "FAIL_TO_PASS", task.id)
        if not f2p:
            raise ConfigError(f"task {task.id!r} has no FAIL_TO_PASS tests")
        repos_dir = _optional(data, "repos_dir")
        return cls(
            instance_id=str(data.get("instance_id", task.id)),
            repo=str(_repo_name(data["repo"])),
            base_commit=base_commit,
            problem_statement=str(data["problem_statement"]),
            test_patch=str(data["test_patch"]),
            fail_to_pass=f2p,
            pass_to_pass=_id_list(data.get("PASS_TO_PASS"), "PASS_TO_PASS", task.id),
            patch=_optional(data, "patch"),
            test_cmd=_optional(data, "test_cmd"),
            version=_optional(data, "version"),
            environment_setup_commit=_optional(data, "environment_setup_commit"),
            image_name=_optional(data, "image_name"),
            repos_dir=Path(repos_dir).expanduser() if repos_dir else None,
        )

    @property
    def test_ids(self) -> tuple[str, ...]:
        """``FAIL_TO_PASS`` then ``PASS_TO_PASS``, each id once."""
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    def mirror(self, repos_dir: Path | None) -> Path:
        """The git directory of this instance's mirror (the task's ``repos_dir`` first)."""
        where = self.repos_dir or repos_dir
        if where is None:
            raise ConfigError(
                f"task {self.instance_id!r}: no repos_dir to find {self.repo}'s mirror in "
                "(set the adapter's repos_dir option, --repos-dir, or the task's repos_dir field)"
            )
        return gitrepos.mirror_path(where, self.repo)


def checkout(instance: SweBenchInstance, dest: Path, *, repos_dir: Path | None = None) -> None:
    """``instance``'s repository at ``base_commit`` in ``dest`` (absent or empty), borrowing the
    mirror's objects (blocking: run it in a thread)."""
    gitrepos.checkout(instance.mirror(repos_dir), instance.base_commit, dest)


def prepare_workdir(task: Task, dest: Path, *, repos_dir: Path | None) -> bool:
    """Check ``task`` out into ``dest`` if it is a SWE-bench instance (True); False otherwise,
    and the caller copies its ``repo`` as before (blocking)."""
    if not is_swebench(task):
        return False
    checkout(SweBenchInstance.from_task(task), dest, repos_dir=repos_dir)
    return True


# --- what of the agent's patch counts -----------------------------------------------------------


def drop_reason(path: str, test_paths: frozenset[str]) -> str | None:
    """Why ``path`` is left out of the agent's patch, or None to keep it (see the docstring)."""
    pure = PurePosixPath(path)
    if path in test_paths:
        return "a test file (the test patch's, or one holding a counted test)"
    if pure.name in CONFIG_FILES or pure.suffix == ".pth":
        return "configures the interpreter or the test run"
    for tested in {str(PurePosixPath(p).parent) for p in test_paths}:
        inside = tested == "." or pure.is_relative_to(tested)
        if not inside:
            continue
        if TEST_DIR_NAMES & set(PurePosixPath(tested).parts):
            return f"in the test directory {tested}/"
        if TEST_FILE.match(pure.name):
            return f"a test file beside the tests in {tested}/"
    return None


def patch_paths(patch: Path, git_dir: Path) -> frozenset[str]:
    """Every path a patch touches (both names of a rename), as ``git apply`` reads it."""
    result = gitrepos.git(["apply", "--numstat", "-z", str(patch)], git_dir=git_dir)
    if result.returncode != 0:
        raise ConfigError(f"the test_patch is not a patch: {result.stderr.decode(errors='replace').strip()}")
    # Records are "added\tdeleted\tpath\0", or "added\tdeleted\t\0old\0new\0" for a rename.
    paths: set[str] = set()
    for item in result.stdout.split(b"\0"):
        parts = item.split(b"\t", 2)
        name = parts[2] if len(parts) == 3 else item
        if name:
            paths.add(os.fsdecode(name))
    return frozenset(paths)


# --- the test run's output ----------------------------------------------------------------------


def parse_pytest_summary(lines: Iterable[str], ids: Sequence[str]) -> dict[str, str]:
    """The status of each of ``ids`` from pytest ``-rA`` lines (``PASSED <id>``, ``FAILED <id> -
    <message>``, ...); an id with any FAILED or ERROR line keeps that status."""
    wanted = set(ids)
    found: dict[str, str] = {}
    for line in lines:
        status, _, rest = line.rstrip("\r\n").partition(" ")
        if status not in STATUSES or not rest:
            continue
        candidates = [rest] + [rest[: m.start()] for m in re.finditer(" - ", rest)]
        test_id = next((c for c in candidates if c in wanted), None)
        if test_id is not None and found.get(test_id) not in FAILING:
            found[test_id] = status
    return found


def _test_files(ids: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(test_id.split("::", 1)[0] for test_id in ids))


@dataclass(frozen=True, slots=True)
class Grade:
    """What the verifier found (``verify/results.json``)."""

    reward: float
    #: Each test id's status (``MISSING``: not in the output).
    statuses: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    #: Why the tests did not run or count (a patch that did not apply, a timeout), or None.
    reason: str | None = None

    def passed(self, test_id: str) -> bool:
        return self.statuses.get(test_id) in PASSING


def score(statuses: dict[str, str], ids: Sequence[str], scoring: Scoring) -> float:
    passed = sum(1 for test_id in ids if statuses.get(test_id) in PASSING)
    if scoring == "fraction":
        return passed / len(ids)
    return 1.0 if passed == len(ids) else 0.0


def read_grade(rollout_root: Path) -> Grade | None:
    """The grade the verifier left in a (kept) rollout directory, if it ran there."""
    try:
        data = json.loads((rollout_root / "verify" / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return Grade(**data)


# --- the verifier -------------------------------------------------------------------------------


def _fresh_dir(path: Path) -> None:
    """``path`` as a new, empty directory (whatever the agent may have left there)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.mkdir()


@dataclass(frozen=True, slots=True)
class SweBenchTests:
    """Reward source: the instance's tests on the agent's changes, in a fresh checkout."""

    timeout_s: float = 300.0
    #: ``binary`` (all tests pass: 1.0) or ``fraction`` (the share that pass).
    scoring: Scoring = "binary"
    #: Where the mirrors are (a task's own ``repos_dir`` wins).
    repos_dir: Path | None = None
    #: Seconds to read the agent's working tree as a patch (past it: reward 0.0).
    diff_timeout_s: float = 120.0

    async def reward(self, task: Task, ctx: VerifyContext) -> float:
        instance = SweBenchInstance.from_task(task)
        verify = RolloutDir(ctx.rdir.root / "verify")
        grade = await asyncio.to_thread(self._prepare, task, instance, ctx.rdir.work, verify)
        if grade.reason is None:
            grade = await self._run_tests(instance, ctx, verify, grade.dropped)
        (verify.root / "results.json").write_text(json.dumps(asdict(grade), indent=1))
        return grade.reward

    def _prepare(self, task: Task, instance: SweBenchInstance, agent_work: Path, verify: RolloutDir) -> Grade:
        """The fresh checkout with the agent's kept changes and the test patch applied
        (blocking): a ``Grade`` with what was dropped, and a reason if the tests cannot run."""
        _fresh_dir(verify.root)
        for part in (verify.home, verify.tmp):
            part.mkdir()
        verify.task_json.write_text(json.dumps({"id": task.id, "data": task.data}, default=str))
        checkout(instance, verify.work, repos_dir=self.repos_dir)
        git_dir = verify.work / ".git"
        test_patch = verify.root / "test.patch"
        test_patch.write_text(instance.test_patch)
        # The files the test patch touches and those holding the counted tests are the tests'.
        test_paths = patch_paths(test_patch, git_dir) | frozenset(_test_files(instance.test_ids))
        index, agent_patch = verify.root / "agent.index", verify.root / "agent.patch"
        try:
            changed = gitrepos.changed_paths(
                git_dir, agent_work, instance.base_commit, index, self.diff_timeout_s
            )
        except gitrepos.TreeError as exc:
            return Grade(0.0, reason=str(exc))
        dropped = {path: why for path in changed if (why := drop_reason(path, test_paths)) is not None}
        (verify.root / "dropped.txt").write_text(
            "".join(f"{p}\t{why}\n" for p, why in sorted(dropped.items()))
        )
        gitrepos.write_patch(
            git_dir,
            instance.base_commit,
            index,
            agent_patch,
            unstage=sorted(dropped),
            timeout_s=self.diff_timeout_s,
        )
        for name, patch in (("the agent's patch", agent_patch), ("the test patch", test_patch)):
            error = gitrepos.apply_patch(verify.work, patch)
            if error is not None:
                (verify.root / "apply.log").write_text(f"{name} does not apply:\n{error}\n")
                return Grade(0.0, dropped=dropped, reason=f"{name} does not apply: {error.splitlines()[-1]}")
        return Grade(0.0, dropped=dropped)

    def _argv(self, instance: SweBenchInstance, verify: RolloutDir) -> list[str]:
        # The verifier's own HOME, TMPDIR and task file, and no user site-packages: nothing the
        # agent left in its own HOME (a usercustomize.py) is imported by the tests.
        env = [
            "env",
            f"HOME={verify.home}",
            f"TMPDIR={verify.tmp}",
            f"TASK_JSON={verify.task_json}",
            f"LA_WORKDIR={verify.work}",
            "PYTHONNOUSERSITE=1",
            "PYTHONDONTWRITEBYTECODE=1",
        ]
        if instance.test_cmd is not None:
            return [*env, "sh", "-c", instance.test_cmd]
        files = _test_files(instance.test_ids)
        return [*env, "python", "-m", "pytest", "-rA", "-p", "no:cacheprovider", *files]

    async def _run_tests(
        self, instance: SweBenchInstance, ctx: VerifyContext, verify: RolloutDir, dropped: dict[str, str]
    ) -> Grade:
        result = await ctx.run("tests", self._argv(instance, verify), timeout_s=self.timeout_s, rdir=verify)
        ids = instance.test_ids
        if result.timed_out:
            statuses = {test_id: "MISSING" for test_id in ids}
            return Grade(0.0, statuses, dropped, reason=f"the tests ran past {self.timeout_s:g} s")
        with result.stdout_path.open(errors="replace") as log:
            found = parse_pytest_summary(log, ids)
        statuses = {test_id: found.get(test_id, "MISSING") for test_id in ids}
        return Grade(score(found, ids, self.scoring), statuses, dropped)


@dataclass(frozen=True, slots=True)
class CodingTests:
    """Reward source for any coding task: ``SweBenchTests`` for a SWE-bench instance, else the
    old schema's ``TaskTests``."""

    timeout_s: float = 300.0
    restore_test_files: bool = True
    scoring: Scoring = "binary"
    repos_dir: Path | None = None

    async def reward(self, task: Task, ctx: VerifyContext) -> float:
        if is_swebench(task):
            return await SweBenchTests(self.timeout_s, self.scoring, self.repos_dir).reward(task, ctx)
        return await TaskTests(self.timeout_s, self.restore_test_files).reward(task, ctx)
