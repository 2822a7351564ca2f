"""``lightning-appliance tasks check``: a coding task set's bugs, found before training.

Owns the ``tasks`` command's flags and the check: for each task, the agent that does nothing
must get 0.0 (for a SWE-bench instance: every ``FAIL_TO_PASS`` test fails) and the agent that
applies the task's gold patch (``patch`` of a SWE-bench instance, ``gold_patch`` of the old
schema) must get 1.0, each run as a real rollout would be (the ``command`` adapter, the task's
own reward source: ``harness_adapters.swebench.SweBenchTests`` or ``coding.TaskTests``). One
line per task (``ok`` or ``FAIL: <why>``) as each ends, a summary; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.cli.common import run_async
from contracts.errors import ApplianceError

if TYPE_CHECKING:
    from harness_adapters.base import Task
    from harness_adapters.rewards import RewardSource

#: The oracle agent: applies the task field named by its argument (read from ``$TASK_JSON``, so
#: any size works) with ``git apply``, never looking above its working directory for a repository.
APPLY_FIELD = (
    "import json, os, subprocess, sys; "
    "patch = json.load(open(os.environ['TASK_JSON']))['data'][sys.argv[1]]; "
    "env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(os.getcwd())); "
    "applied = subprocess.run(['git', 'apply', '--whitespace=nowarn', '-'], input=patch.encode(), env=env); "
    "sys.exit(applied.returncode)"
)
#: The task field the staged checkout of a SWE-bench instance is copied in from.
CHECKOUT_FIELD = "la_checkout"


def add_parser(sub: Any) -> None:
    """``tasks check`` and its flags."""
    tasks = sub.add_parser("tasks", help="check a coding task set before training on it")
    actions = tasks.add_subparsers(dest="tasks_command", required=True)
    check = actions.add_parser(
        "check",
        help="each task: unsolved without its gold patch, solved with it (exit 1 if any is not)",
        description="For each coding task (SWE-bench instances and the SWE-smith-style schema), run the "
        "task's verifier twice as a rollout would: on the repository as given (its FAIL_TO_PASS tests "
        "must fail) and with the gold patch applied (reward 1.0). One line per task, then a summary.",
    )
    check.add_argument("file", type=Path, help="task set: a JSONL or Parquet file or a datasets directory")
    check.add_argument("--repos-dir", type=Path, help="directory of git mirrors owner__name.git")
    check.add_argument("--jobs", type=int, default=4, help="tasks checked at once (default 4)")
    check.add_argument("--timeout-s", type=float, default=300.0, help="seconds one test run may take")
    check.add_argument("--work-dir", type=Path, help="keep the checks' rollout directories here")
    check.add_argument("--json", action="store_true", help="print one JSON object instead of text")


@dataclass(frozen=True, slots=True)
class TaskCheck:
    task_id: str
    ok: bool
    reason: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"{self.task_id}: ok ({self.seconds:.1f} s)"
            if self.ok
            else f"{self.task_id}: FAIL: {self.reason}"
        )


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80] or "task"


async def _rollout(
    task: Task, root: Path, command: list[str], source: RewardSource, *, repo_field: str
) -> tuple[float | None, Path]:
    """One rollout of ``command`` on ``task`` under ``root`` (kept): its reward and directory."""
    from harness_adapters.base import ClientConfig
    from harness_adapters.command import CommandAdapter

    adapter = CommandAdapter(
        command=command,
        workdir_root=root,
        keep_workdirs="always",
        repo_field=repo_field,
        reward_sources=[source],
    )
    client = ClientConfig(
        rollout_id=root.name,
        base_url="http://127.0.0.1:9/v1",
        api_key="tasks-check",
        reward_url="http://127.0.0.1:9/reward",
        model="none",
    )
    reward = await adapter.run(task, client)
    (rdir,) = await asyncio.to_thread(lambda: [p for p in root.iterdir() if p.is_dir()])
    return reward, rdir


async def _check_swebench(task: Task, root: Path, repos_dir: Path | None, timeout_s: float) -> str:
    """'' if the instance is sound, else why not."""
    from harness_adapters.base import Task
    from harness_adapters.swebench import SweBenchInstance, SweBenchTests, checkout, read_grade

    instance = SweBenchInstance.from_task(task)
    if instance.patch is None:
        return "it has no gold patch (patch)"
    staged = root / "checkout"
    await asyncio.to_thread(checkout, instance, staged, repos_dir=repos_dir)
    data = {**task.data, CHECKOUT_FIELD: str(staged)}
    if repos_dir is not None and not data.get("repos_dir"):
        data["repos_dir"] = str(repos_dir)  # for an adapter that checks out by itself
    staged_task = Task(task.id, data)
    verifier = SweBenchTests(timeout_s, "binary", repos_dir)
    _, before = await _rollout(staged_task, root / "before", ["true"], verifier, repo_field=CHECKOUT_FIELD)
    grade = read_grade(before)
    if grade is None or grade.reason is not None:
        return f"without the gold patch: {grade.reason if grade else 'the verifier left no results'}"
    passing = [t for t in instance.fail_to_pass if grade.passed(t)]
    if passing:
        return f"{len(passing)} FAIL_TO_PASS test(s) pass without the gold patch, e.g. {passing[0]}"
    oracle = [sys.executable, "-c", APPLY_FIELD, "patch"]
    reward, after = await _rollout(staged_task, root / "after", oracle, verifier, repo_field=CHECKOUT_FIELD)
    grade = read_grade(after)
    if reward == 1.0:
        return ""
    if grade is None or grade.reason is not None:
        return f"with the gold patch: {grade.reason if grade else 'the verifier left no results'}"
    failing = [f"{t} {s}" for t, s in grade.statuses.items() if not grade.passed(t)]
    dropped = f"; dropped from it: {', '.join(grade.dropped)}" if grade.dropped else ""
    return f"with the gold patch {len(failing)} test(s) do not pass, e.g. {failing[0]}{dropped}"


async def _check_old_schema(task: Task, root: Path, timeout_s: float) -> str:
    from harness_adapters.coding import CodingTask, TaskTests

    coding = CodingTask.from_task(task)
    if coding.gold_patch is None:
        return "it has no gold patch (gold_patch)"
    verifier = TaskTests(timeout_s)
    before, _ = await _rollout(task, root / "before", ["true"], verifier, repo_field="repo")
    if before != 0.0:
        return "its tests pass without the gold patch"
    oracle = [sys.executable, "-c", APPLY_FIELD, "gold_patch"]
    after, _ = await _rollout(task, root / "after", oracle, verifier, repo_field="repo")
    return "" if after == 1.0 else f"with the gold patch the tests still fail (reward {after})"


async def check_task(task: Task, root: Path, *, repos_dir: Path | None, timeout_s: float) -> TaskCheck:
    """Check one task in its own directory ``root``; a failure of any kind is the task's FAIL."""
    from harness_adapters.base import AgentFailed, InfraError
    from harness_adapters.swebench import is_swebench

    started = time.perf_counter()
    await asyncio.to_thread(root.mkdir, parents=True)
    try:
        if is_swebench(task):
            reason = await _check_swebench(task, root, repos_dir, timeout_s)
        else:
            reason = await _check_old_schema(task, root, timeout_s)
    except AgentFailed as exc:
        reason = (
            f"the gold patch does not apply: {exc.detail.strip().splitlines()[-1] if exc.detail else exc}"
        )
    except (ApplianceError, InfraError) as exc:
        reason = str(exc).splitlines()[0]
    return TaskCheck(task.id, not reason, reason, time.perf_counter() - started)


async def _check_all(args: argparse.Namespace, root: Path) -> int:
    from harness_adapters.tasks import TaskSet

    tasks = TaskSet.load(args.file, split=None)
    slots = asyncio.Semaphore(max(1, args.jobs))

    async def one(index: int, task: Task) -> TaskCheck:
        async with slots:
            where = root / f"{index:05d}-{_safe(task.id)}"
            result = await check_task(task, where, repos_dir=args.repos_dir, timeout_s=args.timeout_s)
        if not args.json:
            print(result.line(), flush=True)
        return result

    results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    failed = sum(1 for r in results if not r.ok)
    if args.json:
        print(
            json.dumps({"tasks": [asdict(r) for r in results], "ok": len(results) - failed, "failed": failed})
        )
    else:
        print(f"{len(results)} tasks: {len(results) - failed} ok, {failed} failed")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance tasks check``: 0 when every task is sound, 1 when one is not."""
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="la-tasks-check-", dir=args.work_dir))
    try:
        return run_async(_check_all(args, root))
    finally:
        if args.work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
