"""SWE-bench instances: mirrors, per-rollout checkouts, and a verifier an agent cannot talk round.

Three small Python repositories are built here as bare mirrors (``owner__name.git``), each with
a bug, an upstream fix after ``base_commit`` (its source half is ``patch``, its test half
``test_patch``, both made by git), and written as a SWE-bench task set in JSONL and Parquet.
Agents run through the ``command`` adapter; the verifier runs real pytest.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from contracts.errors import ConfigError
from harness_adapters.base import Task
from harness_adapters.command import CommandAdapter
from harness_adapters.gitrepos import commit_store
from harness_adapters.rewards import RewardSource
from harness_adapters.sandbox import bwrap_problem
from harness_adapters.swebench import (
    CodingTests,
    SweBenchInstance,
    SweBenchTests,
    drop_reason,
    is_swebench,
    parse_pytest_summary,
    prepare_workdir,
    read_grade,
)
from harness_adapters.tasks import TaskSet
from tests.harness_adapters.support import PYTHON_BUGS, client_config

#: Each repository: files at base_commit, the fix's source files, the fix's test files.
CALC_OK = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TEST_SUB = "from calc import add, sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"
TEST_BANG = "from text import shout\n\n\ndef test_bang():\n    assert shout('a').endswith('!')\n"
MEAN = "def mean(xs):\n    return sum(xs) / len(xs)\n\n\n"
LARGEST = "def largest(xs):\n    return max(xs)\n"
REPOS: dict[str, dict[str, dict[str, str]]] = {
    "acme/calc": {
        "base": {"calc/__init__.py": CALC_OK.replace("a + b", "a - b"), "tests/test_calc.py": TEST_SUB},
        "fix": {"calc/__init__.py": CALC_OK},
        "tests": {"tests/test_calc.py": TEST_SUB + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
    },
    "acme/text": {
        "base": {
            "text.py": "def shout(s):\n    return s.lower() + '!'\n",
            "tests/__init__.py": "",
            "tests/test_text.py": TEST_BANG,
        },
        "fix": {"text.py": "def shout(s):\n    return s.upper() + '!'\n"},
        "tests": {
            "tests/test_text.py": TEST_BANG + "\n\ndef test_upper():\n    assert shout('hi') == 'HI!'\n"
        },
    },
    "zeta/stats": {
        "base": {
            "stats/core.py": MEAN.replace(" / ", " // ") + LARGEST.replace("max(xs)", "sorted(xs)[0]"),
            "stats/__init__.py": "from stats.core import largest, mean\n",
            "README.md": "stats\n",
        },
        "fix": {"stats/core.py": MEAN + LARGEST},
        "tests": {
            "tests/test_stats.py": "from stats import largest, mean\n\n\n"
            "def test_mean():\n    assert mean([1, 2]) == 1.5\n\n\n"
            "def test_largest():\n    assert largest([3, 1, 2]) == 3\n"
        },
    },
}
F2P = {
    "acme/calc": ["tests/test_calc.py::test_add"],
    "acme/text": ["tests/test_text.py::test_upper"],
    "zeta/stats": ["tests/test_stats.py::test_mean", "tests/test_stats.py::test_largest"],
}
P2P = {
    "acme/calc": ["tests/test_calc.py::test_sub"],
    "acme/text": ["tests/test_text.py::test_bang"],
    "zeta/stats": [],
}
#: A fix of half of zeta/stats (mean only): one of its two tests passes.
HALF_FIX = MEAN + LARGEST.replace("max(xs)", "sorted(xs)[0]")
GIT_ENV = {
    "PATH": os.environ["PATH"],
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def build_repo(repo: str, spec: dict[str, dict[str, str]], scratch: Path, repos_dir: Path) -> dict[str, Any]:
    """A mirror of ``repo`` whose HEAD is the upstream fix; the SWE-bench record of its bug."""
    work = scratch / repo.replace("/", "__")
    work.mkdir(parents=True)
    git(work, "init", "-q")
    write(work, spec["base"])
    git(work, "add", "-A")
    git(work, "commit", "-qm", "base")
    base = git(work, "rev-parse", "HEAD").strip()
    write(work, spec["fix"] | spec["tests"])
    git(work, "add", "-A")
    git(work, "commit", "-qm", "the upstream fix")
    patch = git(work, "diff", base, "HEAD", "--", *spec["fix"])
    test_patch = git(work, "diff", base, "HEAD", "--", *spec["tests"])
    git(scratch, "clone", "-q", "--mirror", str(work), str(repos_dir / f"{repo.replace('/', '__')}.git"))
    return {
        "instance_id": f"{repo.replace('/', '__')}-1",
        "repo": repo,
        "base_commit": base,
        "problem_statement": f"{repo} has a bug",
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(F2P[repo]),  # as datasets stores them: JSON strings
        "PASS_TO_PASS": json.dumps(P2P[repo]),
        "version": "1.0",
        "environment_setup_commit": base,
    }


def build_task_set(root: Path) -> tuple[Path, Path, list[dict[str, Any]]]:
    """The mirrors' directory, a JSONL task set (and a Parquet copy beside it), its records."""
    repos_dir = root / "repos"
    repos_dir.mkdir(parents=True)
    records = [build_repo(repo, spec, root / "scratch", repos_dir) for repo, spec in REPOS.items()]
    jsonl = root / "swebench.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(records), root / "swebench.parquet")
    return repos_dir, jsonl, records


@pytest.fixture(scope="module")
def task_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    return build_task_set(tmp_path_factory.mktemp("swebench"))


def load(path: Path, repos_dir: Path) -> list[Task]:
    """The task set as the appliance loads it, each task told where the mirrors are."""
    return [Task(t.id, {**t.data, "repos_dir": str(repos_dir)}) for t in TaskSet.load(path, split=None)]


#: Agents: what each does in its working copy (a checkout at base_commit), given the task.
AGENT = """
import json, os, pathlib, subprocess, sys
task = json.loads(pathlib.Path(os.environ["TASK_JSON"]).read_text())["data"]
mode = sys.argv[1]
def apply(patch):
    subprocess.run(["git", "apply", "-"], input=patch.encode(), check=True)
if mode in ("gold", "gold-and-plant"):
    apply(task["patch"])
if mode == "edit-tests":
    # Rewrite the tests the fix will be judged by so that they pass.
    for name in json.loads(task["FAIL_TO_PASS"]):
        path = pathlib.Path(name.split("::")[0])
        path.parent.mkdir(parents=True, exist_ok=True)
        names = [n.split("::")[1] for n in json.loads(task["FAIL_TO_PASS"])]
        path.write_text("".join(f"def {n}():\\n    pass\\n" for n in names))
if mode == "conftest":
    hook = (
        "import pytest\\n\\n\\n@pytest.hookimpl(hookwrapper=True)\\n"
        "def pytest_runtest_makereport(item, call):\\n    outcome = yield\\n"
        "    outcome.get_result().outcome = 'passed'\\n"
    )
    pathlib.Path("conftest.py").write_text(hook)
    pathlib.Path("tests").mkdir(exist_ok=True)
    pathlib.Path("tests/conftest.py").write_text(hook)
if mode == "half":
    pathlib.Path("stats/core.py").write_text(os.environ["HALF_FIX"])
if mode == "gold-and-plant":
    marker = sys.argv[2]
    subprocess.run(["git", "config", "core.fsmonitor", f"touch {marker}"], check=True)
    subprocess.run(["git", "config", "diff.external", f"touch {marker}"], check=True)
"""


def adapter(tmp_path: Path, mode: str, *extra: str, source: RewardSource | None = None) -> CommandAdapter:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    return CommandAdapter(
        command=[sys.executable, str(script), mode, *extra],
        workdir_root=tmp_path / "rollouts",
        repo_field="checkout",
        keep_workdirs="always",
        env={"HALF_FIX": HALF_FIX},
        reward_sources=[source or SweBenchTests(timeout_s=60)],
    )


def staged(task: Task, tmp_path: Path) -> Task:
    """``task`` with a checkout at base_commit for the adapter to start from (until the command
    adapter checks SWE-bench instances out itself with ``prepare_workdir``)."""
    dest = tmp_path / "checkouts" / task.id
    assert prepare_workdir(task, dest, repos_dir=None)
    return Task(task.id, {**task.data, "checkout": str(dest)})


async def run_all(tmp_path: Path, tasks: list[Task], mode: str, *extra: str) -> list[float | None]:
    runner = adapter(tmp_path, mode, *extra)
    prepared = [staged(t, tmp_path / mode) for t in tasks]
    return list(await asyncio.gather(*(runner.run(t, client_config(f"{t.id}-{mode}")) for t in prepared)))


def run_tests_in(work: Path, test_patch: str) -> str:
    """Pytest's output on the agent's own working copy, with the test patch applied."""
    subprocess.run(["git", "apply", "-"], input=test_patch.encode(), cwd=work, env=GIT_ENV, check=True)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "tests"],
        cwd=work,
        capture_output=True,
        text=True,
    )
    return ran.stdout


def only_rollout(tmp_path: Path) -> Path:
    (rdir,) = (tmp_path / "rollouts").iterdir()
    return rdir


# --- the schema -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_instances_load_from_jsonl_and_parquet(
    task_set: tuple[Path, Path, list[dict[str, Any]]], fmt: str
) -> None:
    repos_dir, jsonl, records = task_set
    tasks = load(jsonl.with_suffix(f".{fmt}"), repos_dir)
    assert [t.id for t in tasks] == [r["instance_id"] for r in records]
    for task, record in zip(tasks, records, strict=True):
        assert is_swebench(task)
        instance = SweBenchInstance.from_task(task)
        assert instance.repo == record["repo"]  # not the path tasks.py made of "owner/name"
        assert instance.base_commit == record["base_commit"] and instance.patch == record["patch"]
        assert list(instance.fail_to_pass) == F2P[record["repo"]]
        assert instance.version == "1.0" and instance.repos_dir == repos_dir


def test_schema_errors_are_one_readable_line(tmp_path: Path) -> None:
    old_schema = TaskSet.load(PYTHON_BUGS)[0]
    assert not is_swebench(old_schema)
    assert not prepare_workdir(old_schema, tmp_path / "x", repos_dir=None)
    good = {"repo": "acme/calc", "base_commit": "abc1234", "test_patch": "p", "problem_statement": "s"}
    with pytest.raises(ConfigError, match="no FAIL_TO_PASS"):
        SweBenchInstance.from_task(Task("t", good))
    with pytest.raises(ConfigError, match="not a commit id"):
        SweBenchInstance.from_task(
            Task("t", good | {"base_commit": "--upload-pack=x", "FAIL_TO_PASS": ["a"]})
        )
    task = Task("t", good | {"FAIL_TO_PASS": ["a"]})
    with pytest.raises(ConfigError, match="no repos_dir"):
        prepare_workdir(task, tmp_path / "y", repos_dir=None)
    with pytest.raises(ConfigError, match=r"no mirror of acme/calc .*acme__calc\.git"):
        prepare_workdir(task, tmp_path / "y", repos_dir=tmp_path)


def test_a_missing_commit_is_named(task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    repos_dir, jsonl, _ = task_set
    task = load(jsonl, repos_dir)[0]
    missing = Task(task.id, task.data | {"base_commit": "0" * 40})
    with pytest.raises(ConfigError, match=f"commit {'0' * 40} is not in the mirror"):
        prepare_workdir(missing, tmp_path / "w", repos_dir=None)


# --- the checkout ---------------------------------------------------------------------------------


def test_a_checkout_borrows_its_commits_objects_and_hides_the_future(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    repos_dir, jsonl, records = task_set
    task = load(jsonl, repos_dir)[0]
    dest = tmp_path / "work"
    assert prepare_workdir(task, dest, repos_dir=None)
    mirror = repos_dir / "acme__calc.git"
    store = commit_store(mirror, records[0]["base_commit"])
    alternates = (dest / ".git" / "objects" / "info" / "alternates").read_text().strip()
    assert Path(alternates) == store / "objects", "the commit's own objects, shared, not the mirror's"
    own_objects = [p for p in (dest / ".git" / "objects").rglob("*") if p.is_file() and "info" not in p.parts]
    assert own_objects == [], "a checkout copies no objects"
    assert git(dest, "rev-parse", "HEAD").strip() == records[0]["base_commit"]
    assert git(dest, "status", "--porcelain") == ""
    assert (dest / "calc" / "__init__.py").read_text() == REPOS["acme/calc"]["base"]["calc/__init__.py"]
    # The upstream fix is in the mirror, but nothing the checkout can read holds it: no ref, and
    # no object (the mirror's would all be readable through its alternates).
    assert git(dest, "log", "--all", "--format=%s").split() == ["base"]
    fix = git(mirror, "rev-parse", "HEAD").strip()
    assert fix != records[0]["base_commit"]
    readable = git(dest, "cat-file", "--batch-all-objects", "--batch-check=%(objectname) %(objecttype)")
    commits = [line.split()[0] for line in readable.splitlines() if line.endswith(" commit")]
    assert commits == [records[0]["base_commit"]]
    # A second rollout of the commit reuses its store.
    assert commit_store(mirror, records[0]["base_commit"]) == store


# --- the verifier ---------------------------------------------------------------------------------


async def test_the_gold_patch_scores_one_and_doing_nothing_zero(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    repos_dir, jsonl, _ = task_set
    tasks = load(jsonl, repos_dir)
    assert await run_all(tmp_path, tasks, "gold") == [1.0, 1.0, 1.0]
    assert await run_all(tmp_path, tasks, "noop") == [0.0, 0.0, 0.0]


async def test_the_parquet_task_set_is_graded_the_same(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    repos_dir, jsonl, _ = task_set
    tasks = load(jsonl.with_suffix(".parquet"), repos_dir)
    assert await run_all(tmp_path, tasks[:1], "gold") == [1.0]


@pytest.mark.parametrize("cheat", ["edit-tests", "conftest"])
async def test_an_agent_cannot_pass_by_changing_the_tests(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path, cheat: str
) -> None:
    repos_dir, jsonl, _ = task_set
    (task,) = load(jsonl, repos_dir)[:1]
    assert await run_all(tmp_path, [task], cheat) == [0.0]
    rdir = only_rollout(tmp_path)
    dropped = (rdir / "verify" / "dropped.txt").read_text()
    if cheat == "edit-tests":
        assert "tests/test_calc.py\ta test file (the test patch's" in dropped
    else:
        assert "conftest.py\tconfigures" in dropped and "tests/conftest.py\t" in dropped
        # The cheat is real: with its conftest.py, the failing test is reported as passed.
        output = await asyncio.to_thread(run_tests_in, rdir / "work", task.data["test_patch"])
        assert "PASSED tests/test_calc.py::test_add" in output
    grade = read_grade(rdir)
    assert grade is not None and grade.statuses["tests/test_calc.py::test_add"] == "FAILED"


async def test_fraction_scores_the_share_that_pass(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    repos_dir, jsonl, _ = task_set
    task = staged(load(jsonl, repos_dir)[2], tmp_path)
    fraction = adapter(tmp_path / "f", "half", source=SweBenchTests(timeout_s=60, scoring="fraction"))
    binary = adapter(tmp_path / "b", "half")
    assert await fraction.run(task, client_config("f")) == 0.5
    assert await binary.run(task, client_config("b")) == 0.0
    grade = read_grade(only_rollout(tmp_path / "f"))
    assert grade is not None
    assert grade.statuses == {
        "tests/test_stats.py::test_mean": "PASSED",
        "tests/test_stats.py::test_largest": "FAILED",
    }


async def test_commands_planted_in_the_agents_git_config_never_run(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    repos_dir, jsonl, _ = task_set
    marker = tmp_path / "planted-command-ran"
    assert await run_all(tmp_path, load(jsonl, repos_dir)[:1], "gold-and-plant", str(marker)) == [1.0]
    assert not marker.exists()
    # The plant is real: git run in the agent's repository as usual runs it.
    await asyncio.to_thread(git, only_rollout(tmp_path) / "work", "status")
    assert marker.exists()


async def test_coding_tests_picks_the_verifier_by_schema(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    repos_dir, jsonl, _ = task_set
    swe = staged(load(jsonl, repos_dir)[1], tmp_path)
    gold = adapter(tmp_path / "swe", "gold", source=CodingTests(timeout_s=60))
    assert await gold.run(swe, client_config("swe")) == 1.0
    old = TaskSet.load(PYTHON_BUGS)[0]
    unsolved = CommandAdapter(
        command="true", workdir_root=tmp_path, reward_sources=[CodingTests(timeout_s=60)]
    )
    assert await unsolved.run(old, client_config("old")) == 0.0


# --- the parts ------------------------------------------------------------------------------------


def test_parse_pytest_summary() -> None:
    ids = ["t.py::a", "t.py::b", "t.py::c[x - y]", "t.py::d", "t.py::e"]
    log = [
        "PASSED t.py::a",
        "FAILED t.py::b - AssertionError: 1 - 2",
        "XFAIL t.py::c[x - y] - reason",
        "PASSED t.py::d",
        "ERROR t.py::d - teardown failed",  # an error after a pass is a failure
        "SKIPPED [1] t.py:3: no",
        "PASSED t.py::a_longer_name",
    ]
    assert parse_pytest_summary(log, ids) == {
        "t.py::a": "PASSED",
        "t.py::b": "FAILED",
        "t.py::c[x - y]": "XFAIL",
        "t.py::d": "ERROR",
    }


def test_what_is_dropped_from_the_agents_patch() -> None:
    tests = frozenset({"tests/unit/test_a.py", "src/pkg/test_inline.py"})
    assert drop_reason("tests/unit/test_a.py", tests) is not None
    for config in ("conftest.py", "deep/conftest.py", "tox.ini", "setup.cfg", "pyproject.toml", "x.pth"):
        assert drop_reason(config, tests) is not None, config
    assert drop_reason("tests/unit/helpers.py", tests) is not None  # a test directory: all of it
    assert drop_reason("src/pkg/test_other.py", tests) is not None  # a test file beside the tests
    assert drop_reason("src/pkg/core.py", tests) is None  # the source beside them is the fix
    assert drop_reason("tests/other/helpers.py", tests) is None


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
@pytest.mark.parametrize(
    ("mode", "reward"), [("gold", 1.0), ("noop", 0.0), ("edit-tests", 0.0), ("conftest", 0.0)]
)
async def test_in_the_sandbox_from_the_mirror(
    task_set: tuple[Path, Path, list[dict[str, Any]]], tmp_path: Path, mode: str, reward: float
) -> None:
    """The command adapter checks each instance out itself (``repos_dir``), runs the agent in
    bubblewrap (the mirror visible read-only, its objects borrowed) and grades it in a fresh
    sandbox (``task_tests``)."""
    repos_dir, jsonl, _ = task_set
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    sandboxed = CommandAdapter(
        command=[sys.executable, str(script), mode],
        workdir_root=tmp_path / "rollouts",
        keep_workdirs="always",
        sandbox="bwrap",
        read_only_paths=[tmp_path / "agent.py"],
        repos_dir=repos_dir,
        task_tests=True,
        tests_timeout_s=60,
    )
    tasks = list(TaskSet.load(jsonl, split=None))
    rewards = await asyncio.gather(*(sandboxed.run(t, client_config(f"{mode}-{t.id}")) for t in tasks))
    assert rewards == [reward] * len(tasks)
